#include "epmoe/status.h"

namespace epmoe {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid argument";
    case StatusCode::kIoError: return "i/o error";
    case StatusCode::kUnsupported: return "unsupported";
    case StatusCode::kOutOfMemory: return "out of memory";
    case StatusCode::kInternal: return "internal error";
  }
  return "unknown status";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status bad_argument(std::string_view argument, std::string_view expected, std::string_view given) {
  return Status::invalid_argument(std::string(argument) + ": expected " + std::string(expected) +
                                  ", got " + std::string(given));
}

std::string in_quotes(std::string_view text) {
  std::string result;
  result.reserve(text.size() + 2);
  result += '\'';
  result += text;
  result += '\'';
  return result;
}

}  // namespace epmoe
