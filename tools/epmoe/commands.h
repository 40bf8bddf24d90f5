// The subcommands of the epmoe tool. Each takes the arguments after its name and returns
// the process exit code: 0 success, 1 a check failed, 2 bad arguments or an error.
#pragma once

#include <string>
#include <vector>

namespace epmoe::cli {

int run_check(const std::vector<std::string>& arguments);
int run_bench(const std::vector<std::string>& arguments);

// Prints "epmoe <command>: <message>" and a pointer to --help (the arguments were wrong);
// returns 2.
int usage_error(const std::string& command, const std::string& message);
// Prints "epmoe <command>: <message>" (the arguments were fine, the run failed: a device, a
// file, an allocation); returns 2.
int run_error(const std::string& command, const std::string& message);

}  // namespace epmoe::cli
