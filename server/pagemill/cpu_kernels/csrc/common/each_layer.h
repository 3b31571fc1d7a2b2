// The loop of the whole-model calls (decode.cpp's pagemill_decode_layers*, decode_batched.cpp's
// pagemill_batched_layers_bf16): every layer of a step in one call from Python, not one call
// per layer, because each return to the interpreter costs a few microseconds and may wait for
// the GIL that the shard's event-loop thread holds (shard/gil.py; docs/cpu.md "All the layers
// in one call").
#pragma once
#include <stdint.h>

namespace pagemill {

// layer(i, table, k pool, v pool, window) for layer i = 0.. in turn, with layer i's pointer table
// at address tables[i], its pools at kv[2i] (keys) and kv[2i + 1] (values) and its sliding
// window windows[i] (0: none). Returns 0, or the first non-zero code with its layer's index in
// *failed (the layers before it done, none after it run).
template <class F>
int each_layer(int64_t layers, const int64_t* tables, const int64_t* kv, const int64_t* windows, int64_t* failed,
               F&& layer) {
  for (int64_t i = 0; i < layers; ++i) {
    const int rc = layer(i, (const int64_t*)tables[i], (void*)kv[2 * i], (void*)kv[2 * i + 1], windows[i]);
    if (rc) {
      *failed = i;
      return rc;
    }
  }
  return 0;
}

}  // namespace pagemill
