#include <iostream>

#include "mxscope/cli/cli.hpp"

int main(int argc, char** argv) { return mxscope::cli::run(argc, argv, std::cout, std::cerr); }
