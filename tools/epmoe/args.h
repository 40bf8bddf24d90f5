// Command-line options of one epmoe command: declared with their help, parsed, read back
// with range checks. Every mistake becomes a message that names the option.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "epmoe/status.h"

namespace epmoe::cli {

class Args {
 public:
  Args(std::string usage, std::string summary) : usage_(std::move(usage)), summary_(std::move(summary)) {}

  // --name VALUE (or --name=VALUE); `fallback` is used when absent ("" = no default).
  void option(const std::string& name, const std::string& value_name, const std::string& help,
              const std::string& fallback = "");
  Status parse(const std::vector<std::string>& arguments);

  bool help_requested() const { return help_; }
  std::string help() const;
  bool given(const std::string& name) const { return values_.count(name) != 0; }
  std::string text(const std::string& name) const;
  Result<int64_t> integer(const std::string& name, int64_t min, int64_t max) const;
  // "1,16,64" -> {1, 16, 64}
  Result<std::vector<int64_t>> integer_list(const std::string& name, int64_t min, int64_t max) const;

 private:
  struct Declared {
    std::string value_name, help, fallback;
  };
  std::string usage_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Declared> declared_;
  std::map<std::string, std::string> values_;
  bool help_ = false;
};

}  // namespace epmoe::cli
