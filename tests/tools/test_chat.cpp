// `kiln chat`: each reply is what the engine generates for the whole conversation rendered by the
// template (ChatML here, its rendering written out by hand) and encoded without added special
// tokens; /reset forgets; a conversation past the context loses its oldest turns.
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "../../tools/kiln/chat.h"
#include "test_util.h"

namespace kiln::chat {
namespace {

std::filesystem::path source_dir() { return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path(); }

class Chat : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    engine_ = pipelines::GenerationEngine::from_dir(source_dir() / "models" / "kiln-tiny",
                                                   {.max_seq_len = 160, .max_num_seqs = 1});
  }
  static void TearDownTestSuite() { engine_.reset(); }

  std::string expected_reply(const std::vector<std::pair<std::string, std::string>>& messages) {
    pipelines::GenerationRequest r;
    r.prompt_ids = engine_->tokenizer()->encode(kiln::testing::chatml_prompt(messages), false);
    r.sampling = options().sampling;
    return engine_->generate(std::move(r)).text;
  }
  static ChatOptions options() {
    ChatOptions o;
    o.system = "Be brief.";
    o.sampling.temperature = 0;
    o.sampling.max_new_tokens = 10;
    return o;
  }
  static pipelines::ChatTemplate chatml_template() {
    return pipelines::ChatTemplate::from_file(source_dir() / "tests" / "data" / "chat" / "chatml.jinja");
  }
  static std::unique_ptr<pipelines::GenerationEngine> engine_;
};
std::unique_ptr<pipelines::GenerationEngine> Chat::engine_;

TEST_F(Chat, EachReplyContinuesTheWholeConversation) {
  const std::string first = expected_reply({{"system", "Be brief."}, {"user", "Hello there"}});
  const std::string second =
      expected_reply({{"system", "Be brief."}, {"user", "Hello there"}, {"assistant", first}, {"user", "And then?"}});
  const std::string after_reset = expected_reply({{"system", "Be brief."}, {"user", "Again"}});
  std::istringstream in("Hello there\nAnd then?\n/reset\n\nAgain\n/exit\nnever read\n");
  std::ostringstream out, err;
  EXPECT_EQ(run_chat(*engine_, chatml_template(), options(), in, out, err), 3);
  EXPECT_EQ(out.str(), first + "\n" + second + "\n" + after_reset + "\n");
  EXPECT_NE(err.str().find("reset"), std::string::npos);
}

TEST_F(Chat, AConversationPastTheContextDropsItsOldestTurns) {
  // Each turn of ~60 characters is well over a third of the 160-position context.
  const std::string a(60, 'a'), b(60, 'b'), c(60, 'c');
  std::istringstream in(a + "\n" + b + "\n" + c + "\n");
  std::ostringstream out, err;
  ChatOptions o = options();
  o.sampling.max_new_tokens = 4;
  EXPECT_EQ(run_chat(*engine_, chatml_template(), o, in, out, err), 3);
  EXPECT_NE(err.str().find("oldest turn was dropped"), std::string::npos) << err.str();
  // A single message longer than the context is not sent.
  std::istringstream huge(std::string(2000, 'x') + "\n");
  std::ostringstream out2, err2;
  EXPECT_EQ(run_chat(*engine_, chatml_template(), o, huge, out2, err2), 0);
  EXPECT_NE(err2.str().find("longer than the context"), std::string::npos) << err2.str();
}

}  // namespace
}  // namespace kiln::chat
