// Stacking a checkpoint's per-expert matrices into the operator's layout. Every tensor is
// checked for presence, dtype and shape before any byte is copied.
#include "epmoe/checkpoint_layer.h"

#include <cstring>

#include "epmoe/quantize.h"

namespace epmoe {

namespace {

// Reads named tensors and checks them against what the spec expects.
class Reader {
 public:
  Reader(const SafetensorsFile& file, std::string prefix) : file_(file), prefix_(std::move(prefix)) {}

  Result<Tensor> get(const std::string& name, std::vector<DType> dtypes, std::vector<int64_t> shape) const {
    std::optional<Tensor> tensor = file_.tensor(prefix_ + name);
    if (!tensor) return bad_argument(prefix_ + name, "a tensor in the checkpoint", "none");
    bool dtype_ok = false;
    for (DType dtype : dtypes) dtype_ok |= tensor->dtype == dtype;
    const Tensor expected = Tensor::contiguous(nullptr, dtypes[0], shape);
    if (!dtype_ok || tensor->shape_string() != expected.shape_string())
      return bad_argument(prefix_ + name, std::string(dtype_name(dtypes[0])) + " " + expected.shape_string(),
                          tensor->describe());
    return *tensor;
  }
  bool has(const std::string& name) const { return file_.contains(prefix_ + name); }

  // A weight's scale in the scheme's layout ([rows of blocks, cols of blocks]; per channel
  // [N, 1] or [N]; per tensor [] or [1]), as the flat values the operator's grid takes.
  Result<Tensor> scale(const std::string& weight, const QuantSpec& quant, int64_t n, int64_t k) const {
    const Fp8Blocks blocks = weight_scale_blocks(quant, n, k);
    const std::string name = weight + (quant.scheme == QuantScheme::kFp8Block ? "_scale_inv" : "_scale");
    std::optional<Tensor> tensor = file_.tensor(prefix_ + name);
    if (!tensor) return bad_argument(prefix_ + name, "a tensor in the checkpoint", "none");
    if (tensor->dtype != DType::kF32 || tensor->numel() != blocks.scale_rows() * blocks.scale_cols())
      return bad_argument(prefix_ + name,
                          "f32 with " + std::to_string(blocks.scale_rows() * blocks.scale_cols()) + " values (" +
                              std::string(quant_scheme_name(quant.scheme)) + " of [" + std::to_string(n) + ", " +
                              std::to_string(k) + "])",
                          tensor->describe());
    return *tensor;
  }

 private:
  const SafetensorsFile& file_;
  std::string prefix_;
};

// Copies `parts` (each a whole tensor) one after another into `target` from byte `offset`.
size_t append(const Buffer& target, size_t offset, std::initializer_list<Tensor> parts) {
  for (const Tensor& part : parts) {
    std::memcpy(target.data_as<std::byte>() + offset, part.data, part.nbytes());
    offset += part.nbytes();
  }
  return offset;
}

}  // namespace

Result<CheckpointLayer> load_checkpoint_layer(const SafetensorsFile& file, const std::string& prefix,
                                              const MoeSpec& spec, const ExpertMap& experts) {
  EPMOE_RETURN_IF_ERROR(validate_spec(spec));
  const Reader reader(file, prefix);
  const int E = spec.routing.num_experts;
  if (experts.num_experts() != E)
    return bad_argument("experts", "a map over " + std::to_string(E) + " experts", std::to_string(experts.num_experts()));
  const QuantSpec& quant = spec.quant;
  const bool fp8 = is_fp8(quant.scheme);
  const std::vector<DType> weight_dtypes = fp8 ? std::vector<DType>{DType::kFP8E4M3}
                                               : std::vector<DType>{DType::kBF16, DType::kF32};
  CheckpointLayer layer;
  // The router's shape gives H; the first expert's gate projection gives I.
  std::optional<Tensor> router_view = file.tensor(prefix + "gate.weight");
  if (!router_view || router_view->rank != 2 || router_view->size(0) != E)
    return bad_argument(prefix + "gate.weight", "[E, H] with E = " + std::to_string(E),
                        router_view ? router_view->describe() : "none");
  layer.router_weight = *router_view;
  const int64_t H = router_view->size(1);
  std::optional<Tensor> first_gate = file.tensor(prefix + "experts.0.gate_proj.weight");
  if (!first_gate || first_gate->rank != 2)
    return bad_argument(prefix + "experts.0.gate_proj.weight", "an [I, H] tensor", first_gate ? first_gate->describe() : "none");
  const int64_t I = first_gate->size(0);
  if (quant.scheme == QuantScheme::kFp8Block && I % quant.block_n != 0)
    return bad_argument(prefix + "experts.*.gate_proj", "I divisible by block_n=" + std::to_string(quant.block_n) +
                                                            " (gate and up blocks stack whole)", "I=" + std::to_string(I));
  if (reader.has("gate.e_score_correction_bias")) {
    Result<Tensor> bias = reader.get("gate.e_score_correction_bias", {DType::kF32}, {E});
    if (!bias.ok()) return bias.status();
    layer.correction_bias = bias.value();
  }

  // One projection set (gate, up, down) and where it goes.
  struct Projections {
    Tensor gate, up, down;
    std::optional<Tensor> gate_scale, up_scale, down_scale;
  };
  auto read = [&](const std::string& base, int64_t width) -> Result<Projections> {
    Projections p;
    for (auto [name, target, n, k] : {std::tuple{"gate_proj.weight", &p.gate, width, H},
                                      std::tuple{"up_proj.weight", &p.up, width, H},
                                      std::tuple{"down_proj.weight", &p.down, H, width}}) {
      Result<Tensor> weight = reader.get(base + name, weight_dtypes, {n, k});
      if (!weight.ok()) return weight.status();
      *target = weight.value();
    }
    if (fp8) {
      for (auto [name, target, n, k] : {std::tuple{"gate_proj.weight", &p.gate_scale, width, H},
                                        std::tuple{"up_proj.weight", &p.up_scale, width, H},
                                        std::tuple{"down_proj.weight", &p.down_scale, H, width}}) {
        Result<Tensor> scale = reader.scale(base + name, quant, n, k);
        if (!scale.ok()) return scale.status();
        *target = scale.value();
      }
    }
    return p;
  };

  const int64_t E_local = experts.num_local();
  const DType dtype = fp8 ? DType::kFP8E4M3 : first_gate->dtype;
  auto w13 = std::make_shared<Buffer>(dtype, std::initializer_list<int64_t>{E_local, 2 * I, H});
  auto w2 = std::make_shared<Buffer>(dtype, std::initializer_list<int64_t>{E_local, H, I});
  std::shared_ptr<Buffer> w13_scale, w2_scale;
  if (fp8) {
    std::vector<int64_t> shape13 = weight_scale_shape(quant, E_local, 2 * I, H);
    std::vector<int64_t> shape2 = weight_scale_shape(quant, E_local, H, I);
    w13_scale = std::make_shared<Buffer>(DType::kF32, shape13);
    w2_scale = std::make_shared<Buffer>(DType::kF32, shape2);
  }
  size_t at13 = 0, at2 = 0, at13_scale = 0, at2_scale = 0;
  for (int local = 0; local < E_local; ++local) {
    Result<Projections> p = read("experts." + std::to_string(experts.global_ids()[local]) + ".", I);
    if (!p.ok()) return p.status();
    if (p->gate.dtype != dtype || p->up.dtype != dtype || p->down.dtype != dtype)
      return bad_argument(prefix + "experts." + std::to_string(experts.global_ids()[local]) + ".*",
                          "the dtype of expert 0's (" + std::string(dtype_name(dtype)) + ")", p->gate.describe());
    at13 = append(*w13, at13, {p->gate, p->up});
    at2 = append(*w2, at2, {p->down});
    if (fp8) {
      if (quant.scheme == QuantScheme::kFp8Tensor) {
        // One scale per stacked [2I, H] matrix: gate and up must share it.
        if (*p->gate_scale->data_as<float>() != *p->up_scale->data_as<float>())
          return bad_argument(prefix + "experts." + std::to_string(experts.global_ids()[local]) + ".up_proj.weight_scale",
                              "the gate projection's scale (fp8_tensor stacks gate and up under one)",
                              std::to_string(*p->up_scale->data_as<float>()));
        at13_scale = append(*w13_scale, at13_scale, {*p->gate_scale});
      } else {
        at13_scale = append(*w13_scale, at13_scale, {*p->gate_scale, *p->up_scale});
      }
      at2_scale = append(*w2_scale, at2_scale, {*p->down_scale});
    }
  }
  layer.weights.w13 = w13->view();
  layer.weights.w2 = w2->view();
  layer.storage = {w13, w2};
  if (fp8) {
    layer.weights.w13_scale = w13_scale->view();
    layer.weights.w2_scale = w2_scale->view();
    layer.storage.push_back(w13_scale);
    layer.storage.push_back(w2_scale);
  }

  if (reader.has("shared_experts.gate_proj.weight")) {
    std::optional<Tensor> shared_gate = file.tensor(prefix + "shared_experts.gate_proj.weight");
    const int64_t Is = shared_gate->rank == 2 ? shared_gate->size(0) : 0;
    Result<Projections> p = read("shared_experts.", Is);
    if (!p.ok()) return p.status();
    auto shared13 = std::make_shared<Buffer>(dtype, std::initializer_list<int64_t>{2 * Is, H});
    append(*shared13, 0, {p->gate, p->up});
    layer.weights.shared_w13 = shared13->view();
    layer.weights.shared_w2 = p->down;
    layer.storage.push_back(shared13);
    if (fp8) {
      auto scale13 = std::make_shared<Buffer>(DType::kF32, weight_scale_shape(quant, std::nullopt, 2 * Is, H));
      if (quant.scheme == QuantScheme::kFp8Tensor) {
        append(*scale13, 0, {*p->gate_scale});
      } else {
        append(*scale13, 0, {*p->gate_scale, *p->up_scale});
      }
      layer.weights.shared_w13_scale = scale13->view();
      layer.weights.shared_w2_scale = Tensor::contiguous(p->down_scale->data, DType::kF32,
                                                         weight_scale_shape(quant, std::nullopt, H, Is));
      layer.storage.push_back(scale13);
    }
  }
  return layer;
}

}  // namespace epmoe
