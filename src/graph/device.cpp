#include "kiln/graph/device.h"

#include <charconv>

#include "kiln/errors.h"

namespace kiln {

std::string_view device_kind_name(DeviceKind kind) { return kind == DeviceKind::CPU ? "cpu" : "gpu"; }

std::string DeviceRef::to_string() const {
  return std::string(device_kind_name(kind)) + ":" + std::to_string(id);
}

DeviceRef DeviceRef::parse(std::string_view text) {
  auto fail = [&]() -> ValueError {
    return ValueError("DeviceRef::parse: expected 'cpu:N' or 'gpu:N', got '" + std::string(text) + "'");
  };
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) throw fail();
  const std::string_view kind_text = text.substr(0, colon);
  const std::string_view id_text = text.substr(colon + 1);
  DeviceKind kind;
  if (kind_text == "cpu")
    kind = DeviceKind::CPU;
  else if (kind_text == "gpu")
    kind = DeviceKind::GPU;
  else
    throw fail();
  int id = 0;
  // from_chars accepts no sign or spaces, so "cpu:-1" and "cpu: 1" are rejected here.
  const auto [end, ec] = std::from_chars(id_text.data(), id_text.data() + id_text.size(), id);
  if (id_text.empty() || ec != std::errc() || end != id_text.data() + id_text.size() || id_text[0] == '-')
    throw fail();
  return {kind, id};
}

}  // namespace kiln
