// kiln's exceptions. ValueError is misuse of an API (where MAX raises ValueError); Error and its
// subclasses are everything else. Messages name the thing at fault and what was expected.
#pragma once

#include <stdexcept>
#include <string>

namespace kiln {

class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ShapeError : public Error {  // shapes or ranks that do not fit an op
 public:
  using Error::Error;
};
class DTypeError : public Error {  // dtypes an op or kernel does not accept
 public:
  using Error::Error;
};
class LoadError : public Error {  // a file (weights, artifact, tokenizer) that cannot be read
 public:
  using Error::Error;
};
class ExtensionError : public Error {  // a custom-kernel library or custom op
 public:
  using Error::Error;
};
class ParseError : public Error {  // graph text that does not parse; says line and column
 public:
  using Error::Error;
};
class VerifyError : public Error {  // an IR that breaks an invariant; names the node and operand
 public:
  using Error::Error;
};
class ExecutionError : public Error {  // a failure while a Model runs; names the op and node
 public:
  using Error::Error;
};

}  // namespace kiln
