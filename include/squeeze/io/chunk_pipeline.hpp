#pragma once
// Two-stage chunk pipeline for streaming a file: chunk i's consume (write, hash) runs on a worker while the
// calling thread produces chunk i + 1 (a device-to-host copy, a read). Producing stays on the caller because
// it may use the caller's CUDA stream; consumes run in order, one at a time, so a digest sees bytes in order.
// Hashing and a buffered write + fsync run at about the same rate per stream, so overlapping them (and the copy) is
// what moves a save from their serial rate towards the slower of the two (measured: docs/results.md, Training
// checkpoints).
#include <cstddef>
#include <future>
#include <utility>

namespace squeeze::io {

// produce(i, slot) then consume(i, slot) for i in [0, n); slot = i % 2 names one of two buffers the caller
// owns: slot s is produced again only after its previous consume returned. An exception from either stops
// the pipeline after the running consume finished and is rethrown.
template <class Produce, class Consume>
void pipeline_chunks(std::size_t n, Produce&& produce, Consume&& consume) {
  std::future<void> running;
  for (std::size_t i = 0; i < n; ++i) {
    try {
      produce(i, int(i % 2));
    } catch (...) {
      if (running.valid()) running.wait();
      throw;
    }
    if (running.valid()) running.get();
    running = std::async(std::launch::async, [&consume, i] { consume(i, int(i % 2)); });
  }
  if (running.valid()) running.get();
}

// Runs a and b at once (b on a worker thread); rethrows a's exception, else b's.
template <class A, class B>
void run_both(A&& a, B&& b) {
  auto other = std::async(std::launch::async, std::forward<B>(b));
  try {
    a();
  } catch (...) {
    other.wait();
    throw;
  }
  other.get();
}

}  // namespace squeeze::io
