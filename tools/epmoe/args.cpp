#include "args.h"

#include <charconv>

namespace epmoe::cli {

void Args::option(const std::string& name, const std::string& value_name, const std::string& help,
                  const std::string& fallback) {
  order_.push_back(name);
  declared_[name] = {value_name, help, fallback};
}

Status Args::parse(const std::vector<std::string>& arguments) {
  for (size_t i = 0; i < arguments.size(); ++i) {
    const std::string& argument = arguments[i];
    if (argument == "--help" || argument == "-h") {
      help_ = true;
      continue;
    }
    if (argument.rfind("--", 0) != 0)
      return bad_argument("argument " + in_quotes(argument), "an option starting with --", "a bare word");
    std::string name = argument.substr(2), value;
    const size_t equals = name.find('=');
    const bool inline_value = equals != std::string::npos;
    if (inline_value) {
      value = name.substr(equals + 1);
      name = name.substr(0, equals);
    }
    if (!declared_.count(name))
      return bad_argument("option --" + name, "one of the options listed by --help", "an unknown option");
    if (!inline_value) {
      if (i + 1 >= arguments.size())
        return bad_argument("option --" + name, "a value (" + declared_[name].value_name + ")", "nothing");
      value = arguments[++i];
    }
    values_[name] = value;
  }
  return {};
}

std::string Args::help() const {
  std::string text = "usage: " + usage_ + "\n\n" + summary_ + "\n\noptions:\n";
  for (const std::string& name : order_) {
    const Declared& d = declared_.at(name);
    std::string left = "  --" + name + " " + d.value_name;
    left.resize(std::max<size_t>(left.size() + 2, 30), ' ');
    text += left + d.help + (d.fallback.empty() ? "" : " (default: " + d.fallback + ")") + "\n";
  }
  return text + "  --help                      this text\n";
}

std::string Args::text(const std::string& name) const {
  const auto found = values_.find(name);
  return found != values_.end() ? found->second : declared_.at(name).fallback;
}

namespace {

Result<int64_t> parse_integer(const std::string& option, const std::string& text, int64_t min, int64_t max) {
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  const std::string range = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  if (error != std::errc() || end != text.data() + text.size() || text.empty())
    return bad_argument("option --" + option, range, in_quotes(text));
  if (value < min || value > max) return bad_argument("option --" + option, range, text);
  return value;
}

}  // namespace

Result<int64_t> Args::integer(const std::string& name, int64_t min, int64_t max) const {
  return parse_integer(name, text(name), min, max);
}

Result<std::vector<int64_t>> Args::integer_list(const std::string& name, int64_t min, int64_t max) const {
  std::vector<int64_t> values;
  const std::string list = text(name);
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t comma = std::min(list.find(',', begin), list.size());
    Result<int64_t> value = parse_integer(name, list.substr(begin, comma - begin), min, max);
    if (!value.ok()) return value.status();
    values.push_back(value.value());
    begin = comma + 1;
  }
  return values;
}

}  // namespace epmoe::cli
