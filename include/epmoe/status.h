// Status and Result: how errors cross the public API. A failed Status carries a message a
// user can act on: which argument, what was expected, what was given.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace epmoe {

enum class StatusCode { kOk, kInvalidArgument, kIoError, kUnsupported, kOutOfMemory, kInternal };

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status invalid_argument(std::string message) {
    return {StatusCode::kInvalidArgument, std::move(message)};
  }
  static Status io_error(std::string message) { return {StatusCode::kIoError, std::move(message)}; }
  static Status unsupported(std::string message) {
    return {StatusCode::kUnsupported, std::move(message)};
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: ..." for logs and command-line output.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// The one shape of an argument error: "<argument>: expected <expected>, got <given>".
Status bad_argument(std::string_view argument, std::string_view expected, std::string_view given);

// 'text' in single quotes, for names and values inside messages.
std::string in_quotes(std::string_view text);

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace epmoe

#define EPMOE_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::epmoe::Status epmoe_status_ = (expr);      \
    if (!epmoe_status_.ok()) return epmoe_status_; \
  } while (0)
