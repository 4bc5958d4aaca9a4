// Each CASE_* below must fail to compile with the message its test expects (tests/compile_fail/CMakeLists.txt).
// CASE_valid must compile: it shows the harness itself is sound.
#if defined(CASE_fp8_off_fp8_targets)
#define __CUDA_ARCH_LIST__ 750, 800  // what nvcc defines in a unit built for sm_75 and sm_80 only
#endif
#include <squeeze/squeeze.hpp>
using namespace squeeze;

#if defined(CASE_valid)
using S = Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<4>, Precision<bf16, float>, Checkpointed>;
static_assert(sizeof(S) > 0);
using Q = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 32>, Precision<bf16, float>>;
static_assert(sizeof(Q) > 0);
static_assert(S::stage == 3 && Q::has_lora);
using A8 = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, QuantizedState<8>>;  // 8-bit Adam state
static_assert(A8::state_bits == 8 && A8::state_quantization::group == 256);
static_assert(any_fp8_target({800, 900}) && any_fp8_target({890}) && !any_fp8_target({750, 800}));
using F8 = Strategy<Sharded<Stage3>, Offload<Host>, Precision<fp8, bf16, float>, Checkpointed>;  // FP8 under Stage 3
static_assert(F8::fp8_gemms);
using G = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 16>, Precision<bf16, float>, Checkpointed, Graphed>;  // QLoRA from a graph
static_assert(G::graphed && !Q::graphed);
#elif defined(CASE_duplicate_family)
using S = Strategy<Sharded<Stage1>, Accumulate<2>, Sharded<Stage3>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_duplicate_accumulate)
using S = Strategy<Accumulate<2>, Accumulate<4>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_accumulate_zero)
using A = Accumulate<0>;
static_assert(sizeof(A) > 0);
#elif defined(CASE_stage_out_of_range)
using S = Strategy<Sharded<Stage<4>>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_stage_not_a_tag)
using P = Sharded<int>;
static_assert(sizeof(P) > 0);
#elif defined(CASE_gptq_bits)
using Q = Quantized<5, GPTQ, Group<128>>;
static_assert(sizeof(Q) > 0);
#elif defined(CASE_nf4_bits)
using Q = Quantized<8, NF4>;
static_assert(sizeof(Q) > 0);
#elif defined(CASE_train_frozen_gptq)
using S = Strategy<Quantized<4, GPTQ, Group<128>>, Precision<half, float>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_train_frozen_nf4)
using S = Strategy<Quantized<4, NF4, DoubleQuant>, Precision<bf16, float>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_lora_rank_zero)
using L = LoRA<0, 16>;
static_assert(sizeof(L) > 0);
#elif defined(CASE_offload_without_sharding)
using S = Strategy<Offload<Host>, Precision<bf16, float>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_stream_without_stage3)
using S = Strategy<Sharded<Stage2>, Offload<Host, Streamed>, Precision<bf16, float>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_stream_on_device)
using P = Offload<Device, Streamed>;
static_assert(sizeof(P) > 0);
#elif defined(CASE_stream_quantized_sharded)
using S = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Quantized<4, NF4>, LoRA<8, 16>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_stream_gptq_base)
using S = Strategy<Offload<Host, Streamed>, Quantized<4, GPTQ, Group<128>>, LoRA<8, 16>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_stream_dense_lora)
using S = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, LoRA<8, 16>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_fp8_with_lora)
using S = Strategy<Precision<fp8, bf16, float>, Quantized<4, NF4>, LoRA<8, 16>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_fp8_off_fp8_targets)  // __CUDA_ARCH_LIST__ as nvcc defines it for sm_75 and sm_80 (top of the file)
using P = Precision<fp8, bf16, float>;
static_assert(P::fp8_gemms);
#elif defined(CASE_fp8_half)
using P = Precision<fp8, half, float>;
static_assert(P::fp8_gemms);
#elif defined(CASE_fp8_two_types)
using P = Precision<fp8, bf16>;
static_assert(P::fp8_gemms);
#elif defined(CASE_third_type_without_fp8)
using P = Precision<bf16, float, float>;
static_assert(sizeof(P) > 0);
#elif defined(CASE_own_master_resident)
using S = Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, bf16>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_own_master_fp16)
using S = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<half, half>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_loss_scale_with_bf16)
using S = Strategy<Precision<bf16, float>, DynamicLossScale>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_master_less_precise)
using P = Precision<float, half>;
static_assert(sizeof(P) > 0);
#elif defined(CASE_double_quant_on_gptq)
using Q = Quantized<4, GPTQ, DoubleQuant>;
static_assert(sizeof(Q) > 0);
#elif defined(CASE_group_not_power_of_two)
using Q = Quantized<4, GPTQ, Group<100>>;
static_assert(sizeof(Q) > 0);
#elif defined(CASE_inference_with_accumulation)
using S = Strategy<Quantized<4, GPTQ, Group<128>>, Inference, Accumulate<4>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_not_a_policy)
using S = Strategy<Sharded<Stage1>, int>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_checkpoint_every_zero)
using C = CheckpointEvery<0>;
static_assert(sizeof(C) > 0);
#elif defined(CASE_checkpoint_offload_without_checkpointing)
using S = Strategy<Sharded<Stage3>, CheckpointOffload<Host>>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_checkpoint_offload_not_a_place)
using C = CheckpointOffload<Streamed>;
static_assert(sizeof(C) > 0);
#elif defined(CASE_checkpoint_offload_format)
using C = CheckpointOffload<Host, float>;
static_assert(sizeof(C) > 0);
#elif defined(CASE_graphed_twice)
using S = Strategy<Graphed, Eager>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_graphed_inference)
using S = Strategy<Inference, Graphed>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_graphed_stage3)
using S = Strategy<Sharded<Stage3>, Precision<bf16, float>, Graphed>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_graphed_offload)
using S = Strategy<Sharded<Stage1>, Offload<Host>, Graphed>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_graphed_checkpoint_offload)
using S = Strategy<Precision<bf16, float>, Checkpointed, CheckpointOffload<Host>, Graphed>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_graphed_dynamic_loss_scale)
using S = Strategy<Precision<half, float>, Graphed>;
static_assert(sizeof(S) > 0);
#elif defined(CASE_adamw_uint8_moments)
// The fp32-state AdamW with byte moments: 8-bit state needs its block scales (AdamW8Tensor, adamw8_cpu).
#include <squeeze/kernels/adamw.hpp>
void f(squeeze::kernels::AdamWTensor<float, float, unsigned char> t) { squeeze::kernels::adamw_cpu(t, {}); }
#else
#error "define one CASE_*"
#endif
