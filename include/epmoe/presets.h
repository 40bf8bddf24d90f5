// Model shapes of the MoE layers we serve: one table, read by the command line, the tests
// and the benchmarks.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "epmoe/moe_spec.h"

namespace epmoe {

struct ModelPreset {
  std::string_view name;         // "deepseek-v3"
  std::string_view checkpoint;   // the public Hugging Face checkpoint it describes
  int64_t hidden;                // H
  int64_t intermediate;          // I, per routed expert
  int64_t shared_intermediate;   // I_s of all shared experts together; 0 if none
  bool correction_bias;          // the router has e_score_correction_bias
  MoeSpec spec;                  // routing (with E and k), default quantisation, activation
};

std::span<const ModelPreset> model_presets();
// nullptr if no preset has that name.
const ModelPreset* find_preset(std::string_view name);
// "deepseek-v3, qwen3-235b-a22b, ..." for help texts and errors.
std::string preset_names();

}  // namespace epmoe
