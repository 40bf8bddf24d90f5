/* The stable C ABI of epmoe: the MoE operator and routing for callers outside C++ (the
 * Python package binds it with ctypes, so it needs no PyTorch headers). Plain structs of
 * sizes and pointers; enums travel as their names ("softmax_topk", "bf16", "silu") so a
 * wrong one comes back as an error that lists the choices. Tensors on the CPU run the CPU
 * operator, tensors on the GPU the CUDA one (on `stream`, no host synchronisation).
 * Every function returns EPMOE_OK or an error code; epmoe_last_error() then holds the
 * message (which argument, what was expected, what was given) for the calling thread. */
#ifndef EPMOE_C_API_H_
#define EPMOE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPMOE_C_API_VERSION 1

#if defined(__GNUC__)
#define EPMOE_C_EXPORT __attribute__((visibility("default")))
#else
#define EPMOE_C_EXPORT
#endif

/* Error codes: the values of epmoe::StatusCode. */
enum {
  EPMOE_OK = 0,
  EPMOE_INVALID_ARGUMENT = 1,
  EPMOE_IO_ERROR = 2,
  EPMOE_UNSUPPORTED = 3,
  EPMOE_OUT_OF_MEMORY = 4,
  EPMOE_INTERNAL = 5,
};

/* Element types: the values of epmoe::DType. */
enum {
  EPMOE_F32 = 0,
  EPMOE_BF16 = 1,
  EPMOE_F16 = 2,
  EPMOE_FP8_E4M3 = 3,
  EPMOE_I32 = 4,
  EPMOE_I64 = 5,
};

enum { EPMOE_CPU = 0, EPMOE_CUDA = 1 };

/* A view of one tensor; data == NULL and rank == 0 means absent (optional tensors).
 * Strides in elements. */
typedef struct {
  void* data;
  int32_t dtype;
  int32_t device;
  int32_t rank;
  int64_t shape[4];
  int64_t strides[4];
} epmoe_tensor;

typedef struct {
  const char* kind; /* "softmax_topk", "topk_softmax", "sigmoid_topk", "grouped_topk" */
  int32_t num_experts;
  int32_t top_k;
  int32_t renormalize;
  const char* score_func; /* grouped_topk: "softmax" or "sigmoid"; NULL: softmax */
  int32_t n_group;
  int32_t topk_group;
  float routed_scaling_factor;
} epmoe_routing;

typedef struct {
  epmoe_routing routing;
  const char* quant_scheme; /* "bf16", "fp8_tensor", "fp8_channel", "fp8_block" */
  int32_t block_n, block_k; /* fp8_block */
  const char* activation;   /* "silu" or "gelu" */
  int32_t apply_router_weight_on_input;
} epmoe_spec;

/* The tensors of one fused_experts call (include/epmoe/moe_spec.h has every layout):
 * x [T, H], w13 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I],
 * topk_ids [T, k] i32 global ids, topk_weights [T, k] f32, expert_map [E] i32 (local
 * index or -1; absent: all experts local), out [T, H]. */
typedef struct {
  epmoe_tensor x, w13, w2;
  epmoe_tensor w13_scale, w2_scale;              /* fp8 schemes */
  epmoe_tensor input_scale, intermediate_scale;  /* fp8_tensor static activation scales */
  epmoe_tensor topk_ids, topk_weights, expert_map;
  epmoe_tensor out;
} epmoe_moe_tensors;

EPMOE_C_EXPORT int epmoe_c_api_version(void);

/* The message of the calling thread's last failed call ("" if none). */
EPMOE_C_EXPORT const char* epmoe_last_error(void);

/* Bytes of device workspace epmoe_fused_experts needs for these tensors (0 on the CPU).
 * Checks everything epmoe_fused_experts checks. */
EPMOE_C_EXPORT int epmoe_fused_experts_workspace_bytes(const epmoe_spec* spec, const epmoe_moe_tensors* tensors,
                                                       size_t* bytes);

/* out = the MoE layer. On the GPU: enqueued on `stream` (a cudaStream_t; NULL: the default
 * stream) with `workspace` of at least epmoe_fused_experts_workspace_bytes bytes, 256-byte
 * aligned; capturable in a CUDA graph. On the CPU: computed before the call returns. */
EPMOE_C_EXPORT int epmoe_fused_experts(const epmoe_spec* spec, const epmoe_moe_tensors* tensors, void* workspace,
                                       size_t workspace_bytes, void* stream);

/* topk_ids [T, k] i32 and topk_weights [T, k] f32 from router_logits [T, E] (f32 or bf16);
 * correction_bias [E] f32 for grouped_topk, or NULL. */
EPMOE_C_EXPORT int epmoe_route(const epmoe_routing* routing, const epmoe_tensor* router_logits,
                               const epmoe_tensor* correction_bias, const epmoe_tensor* topk_ids,
                               const epmoe_tensor* topk_weights, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* EPMOE_C_API_H_ */
