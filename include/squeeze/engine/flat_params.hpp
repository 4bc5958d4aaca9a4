#pragma once
// FlatParams: a group of parameters (one dtype, one device) packed into one contiguous buffer, padded so
// that every one of `world` ranks owns an equal shard; the parameters (and their gradients) become views
// into the flat buffers, so one collective or one fused optimizer launch covers the whole group.
//
// Layout of a group of n parameters with numel k_i over `world` ranks, alignment a elements:
//   offset_0 = 0, offset_{i+1} = round_up(offset_i + k_i, a)      (every tensor starts aligned)
//   used   = offset_{n-1} + k_{n-1}
//   padded = round_up(used, world * a)                              (equal shards, each starting aligned)
//   shard  = padded / world;  rank r owns [r * shard, (r + 1) * shard)
// Padding elements are zero in the parameter and the gradient buffers and stay zero: they add nothing to
// a sum or a norm, and AdamW keeps a zero weight with zero gradient at zero (decay of 0 is 0).
//
// The torch layer: errors are TORCH_CHECK failures.
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace squeeze::engine {

struct FlatEntry {
  std::string name;
  torch::Tensor param;  // the module's parameter (a view into the flat buffer once packed)
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel = 0;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

class FlatParams {
 public:
  FlatParams() = default;

  // Packs `params` (name, tensor). align_elems >= 1. With materialize=false the flat buffer is not
  // allocated and the parameters are left alone (stage 3 builds the layout, then shards it itself).
  FlatParams(std::vector<std::pair<std::string, torch::Tensor>> params, int world, int64_t align_elems = 1, bool materialize = true)
      : world_(world), align_(align_elems) {
    TORCH_CHECK(world >= 1, "FlatParams: world size must be >= 1, got ", world);
    TORCH_CHECK(align_elems >= 1, "FlatParams: alignment must be >= 1 element, got ", align_elems);
    TORCH_CHECK(!params.empty(), "FlatParams: a group needs at least one parameter");
    const auto dtype = params.front().second.scalar_type();
    const auto device = params.front().second.device();
    int64_t off = 0;
    for (auto& [name, p] : params) {
      TORCH_CHECK(p.defined(), "FlatParams: parameter '", name, "' is undefined");
      TORCH_CHECK(p.scalar_type() == dtype, "FlatParams: parameter '", name, "' is ", p.scalar_type(), " but the group is ", dtype,
                  "; convert the module to one dtype first (module->to(dtype))");
      TORCH_CHECK(p.device() == device, "FlatParams: parameter '", name, "' is on ", p.device(), " but the group is on ", device);
      off = round_up(off, align_);
      entries_.push_back({name, p, p.sizes().vec(), off, p.numel()});
      off += p.numel();
    }
    used_ = off;
    padded_ = round_up(std::max<int64_t>(used_, 1), int64_t(world) * align_);
    shard_ = padded_ / world;
    options_ = torch::TensorOptions().dtype(dtype).device(device);
    if (materialize) {
      flat_ = torch::zeros({padded_}, options_);
      torch::NoGradGuard no_grad;
      for (auto& e : entries_) {
        view(flat_, e).copy_(e.param.detach());
        e.param.set_data(view(flat_, e));
      }
    }
  }

  // The [numel] slice of a flat buffer belonging to entry e, shaped like the parameter.
  static torch::Tensor view(const torch::Tensor& flat, const FlatEntry& e) { return flat.narrow(0, e.offset, e.numel).view(e.shape); }

  // Gradient views: allocates a zeroed flat gradient buffer [padded] in `dtype` (default: the params')
  // and sets every parameter's .grad to its slice, so autograd accumulates straight into it (it adds in
  // place into an existing .grad). Never set grads to None while this is in use: zero_grad() instead.
  void attach_grads() {
    grad_ = torch::zeros({padded_}, options_);
    for (auto& e : entries_) e.param.mutable_grad() = view(grad_, e);
  }
  // Moves the parameters' own .grad (one tensor each, as autograd made them) into a flat buffer [padded]:
  // added into `into` (allocated zeroed in `dtype` when undefined), each .grad freed once moved.
  void move_grads_into(torch::Tensor& into, torch::ScalarType dtype) {
    torch::NoGradGuard no_grad;
    if (!into.defined()) into = torch::zeros({padded_}, options_.dtype(dtype));
    for (auto& e : entries_) {
      torch::Tensor& g = e.param.mutable_grad();
      if (!g.defined()) continue;
      view(into, e).add_(g);
      g.reset();
    }
  }
  // The same into this group's own gradient buffer (the parameters' dtype).
  void collect_grads() { move_grads_into(grad_, options_.dtype().toScalarType()); }
  void zero_grad() {
    if (grad_.defined()) grad_.zero_();
  }
  // Frees the gradient buffer: the parameters' .grad become undefined until attach_grads() again.
  void release_grads() {
    for (auto& e : entries_) e.param.mutable_grad().reset();
    grad_ = torch::Tensor();
  }

  // Rank r's slice of a flat buffer: [shard].
  torch::Tensor shard_of(const torch::Tensor& flat, int rank) const { return flat.narrow(0, int64_t(rank) * shard_, shard_); }

  const torch::Tensor& flat() const { return flat_; }
  const torch::Tensor& grad() const { return grad_; }
  std::vector<FlatEntry>& entries() { return entries_; }
  const std::vector<FlatEntry>& entries() const { return entries_; }
  int64_t used() const { return used_; }      // elements holding parameters (+ alignment gaps)
  int64_t padded() const { return padded_; }  // world * shard
  int64_t shard() const { return shard_; }
  int world() const { return world_; }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& e : entries_) n += e.numel;
    return n;
  }
  torch::TensorOptions options() const { return options_; }
  int64_t element_size() const { return int64_t(c10::elementSize(options_.dtype().toScalarType())); }

 private:
  int world_ = 1;
  int64_t align_ = 1, used_ = 0, padded_ = 0, shard_ = 0;
  torch::TensorOptions options_;
  std::vector<FlatEntry> entries_;
  torch::Tensor flat_, grad_;
};

}  // namespace squeeze::engine
