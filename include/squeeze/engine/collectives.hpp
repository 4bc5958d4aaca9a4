#pragma once
// Tensor collectives of the torch layer (blocking: they synchronize the communicator). At world size 1
// they are a torch copy or nothing, so a single process works with any backend on any device, whatever
// its translation unit was compiled with.
#include <torch/torch.h>

#include "squeeze/comm/communicator.hpp"
#include "squeeze/engine/streams.hpp"
#include "squeeze/engine/torch_types.hpp"

namespace squeeze::engine {

//   gather_into:         shard [n] -> full [size*n] (shard may be full's own slice: in place)
//   reduce_scatter_avg:  full [size*n] -> shard [n], average over ranks (shard may be full's own slice)
// Whether collectives run asynchronously on a side stream: a communicator that takes device memory and honours
// streams (NCCL; at world size 1 too, where NCCL's collectives are copies: that is how one GPU tests this path).
inline bool asynchronous_collectives(torch::Device d, const comm::Communicator& c) {
  return d.is_cuda() && c.device_buffers() && c.backend() != "local";
}

inline void gather_into(comm::Communicator& c, const torch::Tensor& shard, const torch::Tensor& full) {
  if (c.size() == 1) {
    if (shard.data_ptr() != full.data_ptr()) full.copy_(shard);
    return;
  }
  c.all_gather(shard.data_ptr(), full.data_ptr(), std::size_t(shard.numel()), comm_dtype(full.scalar_type()));
  c.synchronize();
}
inline void reduce_scatter_avg(comm::Communicator& c, const torch::Tensor& full, const torch::Tensor& shard) {
  if (c.size() == 1) {
    if (shard.data_ptr() != full.data_ptr()) shard.copy_(full.narrow(0, 0, shard.numel()));
    return;
  }
  c.reduce_scatter(full.data_ptr(), shard.data_ptr(), std::size_t(shard.numel()), comm_dtype(full.scalar_type()), comm::ReduceOp::avg);
  c.synchronize();
}
// Reduce-scatters full [size*n] (average over ranks), adds this rank's part into grad_shard [n], then runs then()
// (an offload hand-over): asynchronously on `side` behind the compute queued so far on `device`'s current stream
// when the side stream is active (its work then follows the add), else blocking.
template <class Then>
void reduce_scatter_add(comm::Communicator& c, SideStream& side, torch::Device device, const torch::Tensor& full,
                        const torch::Tensor& grad_shard, Then&& then) {
  if (side.active()) {
    side.wait(record_current(device));
    side.record_use(full);
    side.run([&] {
      auto mine = torch::empty({grad_shard.numel()}, full.options());
      c.reduce_scatter(full.data_ptr(), mine.data_ptr(), std::size_t(mine.numel()), comm_dtype(full.scalar_type()), comm::ReduceOp::avg,
                       side.handle());
      grad_shard.add_(mine);
      then();
    });
    return;
  }
  auto mine = torch::empty({grad_shard.numel()}, full.options());
  reduce_scatter_avg(c, full, mine);
  grad_shard.add_(mine);
  then();
}

inline void all_reduce_inplace(comm::Communicator& c, const torch::Tensor& t, comm::ReduceOp op) {
  if (c.size() == 1) return;
  c.all_reduce(t.data_ptr(), t.data_ptr(), std::size_t(t.numel()), comm_dtype(t.scalar_type()), op);
  c.synchronize();
}
inline void broadcast_inplace(comm::Communicator& c, const torch::Tensor& t, int root) {
  if (c.size() == 1) return;
  c.broadcast(t.data_ptr(), t.data_ptr(), std::size_t(t.numel()), comm_dtype(t.scalar_type()), root);
  c.synchronize();
}

}  // namespace squeeze::engine
