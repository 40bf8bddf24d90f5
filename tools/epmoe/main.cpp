// epmoe: the command line of the engine (check, bench; generate and serve come later).
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"

namespace {

constexpr const char* kHelp =
    "usage: epmoe <command> [options]\n\n"
    "commands:\n"
    "  check   run the MoE operator on random data (or a case file) and compare it with an\n"
    "          independent double-precision reference\n"
    "  bench   time the MoE operator and print it beside the roofline floor\n\n"
    "'epmoe <command> --help' lists a command's options.\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kHelp, stderr);
    return 2;
  }
  const std::string command = argv[1];
  const std::vector<std::string> arguments(argv + 2, argv + argc);
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kHelp, stdout);
    return 0;
  }
  if (command == "check") return epmoe::cli::run_check(arguments);
  if (command == "bench") return epmoe::cli::run_bench(arguments);
  std::fprintf(stderr, "epmoe: unknown command '%s'\n\n%s", command.c_str(), kHelp);
  return 2;
}
