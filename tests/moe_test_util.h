// Helpers shared by the operator tests: a random case from a few sizes, and running the
// operator into a NaN-poisoned output.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "epmoe/moe_case.h"
#include "epmoe/moe_cpu.h"
#include "epmoe/naive_moe.h"

namespace epmoe::testing {

// A fresh seed per call, printed on failure through the case's description.
inline uint64_t fresh_seed() {
  static std::mt19937_64 rng(std::random_device{}());
  return rng();
}

inline MoeCase random_case(RandomCaseOptions options) {
  Result<MoeCase> moe_case = make_random_case(options);
  EXPECT_TRUE(moe_case.ok()) << moe_case.status().message();
  return std::move(moe_case).value();
}

// Runs the operator into an output filled with NaN first; every element must be written.
inline std::vector<double> run_poisoned(const MoeCase& moe_case, int threads = 0) {
  const Tensor& x = moe_case.inputs.x;
  Buffer out(x.dtype, {x.size(0), x.size(1)});
  EXPECT_TRUE(fill_with_nan(out.view()).ok());
  const Status status = moe_forward_cpu(moe_case.spec, moe_case.weights, moe_case.inputs, out.view(), {threads});
  EXPECT_TRUE(status.ok()) << status.message();
  std::vector<double> values = to_doubles(out.view());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_FALSE(std::isnan(values[i])) << "output element " << i << " not written";
    if (std::isnan(values[i])) break;
  }
  return values;
}

inline double norm(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v * v;
  return std::sqrt(sum);
}

}  // namespace epmoe::testing
