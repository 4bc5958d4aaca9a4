#pragma once
// bitsandbytes NF4 weights (Linear4bit / Params4bit) as transformers saves them, torch-free. For a module
// `m` holding W [out, in] (n = out * in values, blocksize B, default 64):
//   m.weight                                 U8  [ceil(n/2), 1]  two codes a byte, value 2j in the high nibble
//   m.weight.absmax                          F32 [blocks]        plain; U8 [blocks] codes when nested
//   m.weight.quant_map                       F32 [16]            the NF4 table
//   m.weight.nested_absmax                   F32 [ceil(blocks/256)]   (nested = DoubleQuant)
//   m.weight.nested_quant_map                F32 [256]           the dynamic map (quant/bnb_dynamic_map.hpp)
//   m.weight.quant_state.bitsandbytes__nf4   U8  [len]           UTF-8 JSON: quant_type, blocksize, dtype, shape,
//                                                                (nested_blocksize, nested_dtype, nested_offset)
// Nested, as bitsandbytes does it: offset = mean(absmax); (absmax - offset) quantized blockwise (256) to
// dynamic-map codes; absmax' = nested_quant_map[code] * nested_absmax[b / 256] + offset (a product, then a sum).
// The weight codes are chosen against the exact absmax (bitsandbytes quantizes the weights first).
// squeeze's NF4 tensors (quant/nf4.hpp; DoubleQuant is this nested form) are the same numbers: to_nf4_packed and
// from_nf4_packed move them between the two spellings unchanged, the file's own nested map included.
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "squeeze/quant/bnb_dynamic_map.hpp"
#include "squeeze/quant/nf4.hpp"
#include "squeeze/io/hf_quant_layout.hpp"

namespace squeeze::io {

inline constexpr const char* kBnbNf4StateKey = "quant_state.bitsandbytes__nf4";

// The non-tensor part of a QuantState (the JSON blob).
struct BnbQuantStateInfo {
  std::string quant_type = "nf4";
  int blocksize = 64;
  std::string dtype = "bfloat16";   // the original weight's torch dtype, without "torch."
  std::vector<std::int64_t> shape;  // the original weight's shape
  bool nested = false;
  int nested_blocksize = quant::kBnbNestedBlock;
  std::string nested_dtype = "float32";
  float nested_offset = 0.f;
  bool operator==(const BnbQuantStateInfo&) const = default;
};

// One Linear4bit weight in bitsandbytes' terms.
struct BnbNf4Weight {
  BnbQuantStateInfo info;
  std::vector<std::uint8_t> codes;                                                                           // [ceil(n/2)]
  std::vector<float> absmax;                                                                                 // [blocks] (plain)
  std::vector<std::uint8_t> absmax_codes;                                                                    // [blocks] (nested)
  std::vector<float> nested_absmax;                                                                          // [ceil(blocks/256)] (nested)
  std::vector<float> nested_quant_map = {quant::bnb_dynamic_map().begin(), quant::bnb_dynamic_map().end()};  // [256], as read

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : info.shape) n *= d;
    return n;
  }
  std::int64_t blocks() const { return (numel() + info.blocksize - 1) / info.blocksize; }
};

// ---- the JSON blob ----------------------------------------------------------------------------------------
inline std::string encode_quant_state(const BnbQuantStateInfo& s) {
  nlohmann::ordered_json j = {{"quant_type", s.quant_type}, {"blocksize", s.blocksize}, {"dtype", s.dtype}, {"shape", s.shape}};
  if (s.nested) {
    j["nested_blocksize"] = s.nested_blocksize;
    j["nested_dtype"] = s.nested_dtype;
    j["nested_offset"] = double(s.nested_offset);  // a float32 value; the double prints it exactly
  }
  return j.dump();
}

inline BnbQuantStateInfo decode_quant_state(std::string_view text, const std::string& key) {
  const auto j = nlohmann::json::parse(text, nullptr, false);
  check(!j.is_discarded() && j.is_object(), "bitsandbytes quant state '" + key + "' is not a JSON object");
  const auto need = [&](const char* k) -> const nlohmann::json& {
    check(j.contains(k), "bitsandbytes quant state '" + key + "' has no '" + k + "'");
    return j[k];
  };
  BnbQuantStateInfo s;
  const auto type = need("quant_type");
  check(type.is_string() && type.get<std::string>() == "nf4",
        "bitsandbytes quant state '" + key + "': quant_type " + type.dump() + " is not supported (nf4)");
  check(need("blocksize").is_number_integer(), "bitsandbytes quant state '" + key + "': blocksize must be an integer");
  s.blocksize = j["blocksize"].get<int>();
  check(s.blocksize >= 2 && (s.blocksize & (s.blocksize - 1)) == 0,
        "bitsandbytes quant state '" + key + "': blocksize " + std::to_string(s.blocksize) + " is not a power of two >= 2");
  check(need("dtype").is_string(), "bitsandbytes quant state '" + key + "': dtype must be a string");
  s.dtype = j["dtype"].get<std::string>();
  check(need("shape").is_array() && !j["shape"].empty(), "bitsandbytes quant state '" + key + "': shape must be a non-empty list");
  for (const auto& d : j["shape"]) {
    check(d.is_number_integer() && d.get<std::int64_t>() > 0, "bitsandbytes quant state '" + key + "': shape has a non-positive entry");
    s.shape.push_back(d.get<std::int64_t>());
  }
  s.nested = j.contains("nested_offset");
  if (s.nested) {
    check(need("nested_blocksize").is_number_integer() && j["nested_blocksize"].get<int>() > 0,
          "bitsandbytes quant state '" + key + "': nested_blocksize must be a positive integer");
    s.nested_blocksize = j["nested_blocksize"].get<int>();
    check(need("nested_offset").is_number(), "bitsandbytes quant state '" + key + "': nested_offset must be a number");
    s.nested_offset = j["nested_offset"].get<float>();
    if (j.contains("nested_dtype")) {
      check(j["nested_dtype"].is_string(), "bitsandbytes quant state '" + key + "': nested_dtype must be a string");
      s.nested_dtype = j["nested_dtype"].get<std::string>();
    }
    check(s.nested_dtype == "float32", "bitsandbytes quant state '" + key + "': nested_dtype '" + s.nested_dtype + "' is not supported");
  }
  return s;
}

// ---- squeeze's NF4 tensors --------------------------------------------------------------------------------
inline quant::Nf4Packed to_nf4_packed(const BnbNf4Weight& b) {
  quant::Nf4Packed p;
  p.n = b.numel();
  p.block = b.info.blocksize;
  p.codes = b.codes;
  p.double_quant = b.info.nested;
  if (!b.info.nested) {
    p.absmax = b.absmax;
    return p;
  }
  check(b.info.nested_blocksize == kernels::quant::kNf4DqBlock, "bitsandbytes NF4: nested_blocksize " +
                                                                    std::to_string(b.info.nested_blocksize) + " is not supported (" +
                                                                    std::to_string(kernels::quant::kNf4DqBlock) + ")");
  p.absmax_code = b.absmax_codes;
  p.nested_absmax = b.nested_absmax;
  p.nested_map = b.nested_quant_map;
  p.absmax_offset = b.info.nested_offset;
  return p;
}

inline BnbNf4Weight from_nf4_packed(const quant::Nf4Packed& p, std::vector<std::int64_t> shape, std::string dtype = "bfloat16") {
  BnbNf4Weight b;
  b.info = {.blocksize = p.block, .dtype = std::move(dtype), .shape = std::move(shape), .nested = p.double_quant};
  check(b.numel() == p.n, "from_nf4_packed: shape holds " + std::to_string(b.numel()) + " values, the NF4 tensor " + std::to_string(p.n));
  b.codes = p.codes;
  if (!p.double_quant) {
    b.absmax = p.absmax;
    return b;
  }
  b.info.nested_offset = p.absmax_offset;
  b.absmax_codes = p.absmax_code;
  b.nested_absmax = p.nested_absmax;
  b.nested_quant_map = p.nested_map;
  return b;
}

// W (shape, flattened row-major) -> bitsandbytes' NF4 state (quant::nf4_quantize); nested = DoubleQuant.
inline BnbNf4Weight bnb_nf4_quantize(std::span<const float> w, std::vector<std::int64_t> shape, bool nested, int blocksize = 64,
                                     std::string dtype = "bfloat16") {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  check(n == std::int64_t(w.size()), "bnb_nf4_quantize: shape holds " + std::to_string(n) + " values, got " + std::to_string(w.size()));
  return from_nf4_packed(quant::nf4_quantize(w.data(), n, {.block = blocksize, .double_quant = nested}), std::move(shape),
                         std::move(dtype));
}

// The values of W (flattened), as bitsandbytes' dequantize_4bit gives them.
inline std::vector<float> bnb_nf4_dequantize(const BnbNf4Weight& b) {
  std::vector<float> out(std::size_t(b.numel()));
  quant::nf4_dequantize(to_nf4_packed(b), out.data());
  return out;
}

// ---- config.json's quantization_config (transformers' BitsAndBytesConfig.to_dict for load_in_4bit) ------
struct BnbConfig {
  bool double_quant = true;                // bnb_4bit_use_double_quant
  std::string compute_dtype = "bfloat16";  // bnb_4bit_compute_dtype
  bool operator==(const BnbConfig&) const = default;
};

inline nlohmann::json bnb_quantization_config_json(const BnbConfig& c) {
  return {{"quant_method", "bitsandbytes"},
          {"load_in_4bit", true},
          {"load_in_8bit", false},
          {"_load_in_4bit", true},
          {"_load_in_8bit", false},
          {"bnb_4bit_quant_type", "nf4"},
          {"bnb_4bit_use_double_quant", c.double_quant},
          {"bnb_4bit_compute_dtype", c.compute_dtype},
          {"bnb_4bit_quant_storage", "uint8"},
          {"llm_int8_threshold", 6.0},
          {"llm_int8_skip_modules", nullptr},
          {"llm_int8_enable_fp32_cpu_offload", false},
          {"llm_int8_has_fp16_weight", false}};
}

// Refuses what this reader does not take (8-bit, fp4, another quant_method or storage), naming the key.
inline BnbConfig parse_bnb_quantization_config(const nlohmann::json& j, const std::string& source = "config.json quantization_config") {
  check(j.is_object(), source + ": is not a JSON object");
  const auto str = [&](const char* k, const char* def) {
    if (!j.contains(k) || j[k].is_null()) return std::string(def);
    check(j[k].is_string(), source + ": '" + k + "' must be a string");
    return j[k].get<std::string>();
  };
  const auto method = str("quant_method", "");
  check(method == "bitsandbytes", source + ": quant_method '" + method + "' is not 'bitsandbytes'");
  check(j.value("load_in_4bit", false) == true, source + ": 'load_in_4bit' is not true (8-bit bitsandbytes is not supported)");
  const auto type = str("bnb_4bit_quant_type", "fp4");
  check(type == "nf4", source + ": bnb_4bit_quant_type '" + type + "' is not supported (nf4)");
  const auto storage = str("bnb_4bit_quant_storage", "uint8");
  check(storage == "uint8", source + ": bnb_4bit_quant_storage '" + storage + "' is not supported (uint8)");
  BnbConfig c;
  c.double_quant = j.value("bnb_4bit_use_double_quant", false);
  c.compute_dtype = str("bnb_4bit_compute_dtype", "float32");
  return c;
}

// ---- the state-dict keys ----------------------------------------------------------------------------------
// The tensors transformers saves for Linear4bit `module` ("model.layers.0.self_attn.q_proj"), by full name.
inline NamedTensors bnb_nf4_tensors(const std::string& module, const BnbNf4Weight& b) {
  namespace kq = kernels::quant;
  const std::string w = module + ".weight";
  NamedTensors t;
  check(std::int64_t(b.codes.size()) == kq::nf4_code_bytes(b.numel()),
        "bnb_nf4_tensors: '" + w + "' has " + std::to_string(b.codes.size()) + " code bytes, its shape needs " +
            std::to_string(kq::nf4_code_bytes(b.numel())));
  t.push_back({w, owned_tensor<std::uint8_t>(DType::U8, {std::int64_t(b.codes.size()), 1}, b.codes)});
  std::array<float, 16> nf4{};
  for (int c = 0; c < 16; ++c) nf4[c] = kq::nf4_code_value(c);
  t.push_back({w + ".quant_map", owned_tensor<float>(DType::F32, {16}, nf4)});
  if (b.info.nested) {
    t.push_back({w + ".absmax", owned_tensor<std::uint8_t>(DType::U8, {std::int64_t(b.absmax_codes.size())}, b.absmax_codes)});
    t.push_back({w + ".nested_absmax", owned_tensor<float>(DType::F32, {std::int64_t(b.nested_absmax.size())}, b.nested_absmax)});
    check(b.nested_quant_map.size() == 256, "bnb_nf4_tensors: '" + w + "' needs a 256-entry nested quant map");
    t.push_back({w + ".nested_quant_map", owned_tensor<float>(DType::F32, {256}, b.nested_quant_map)});
  } else {
    t.push_back({w + ".absmax", owned_tensor<float>(DType::F32, {std::int64_t(b.absmax.size())}, b.absmax)});
  }
  const auto json = encode_quant_state(b.info);
  t.push_back({w + "." + kBnbNf4StateKey, owned_tensor<char>(DType::U8, {std::int64_t(json.size())}, json)});
  return t;
}

// Reads Linear4bit `module` back from a checkpoint; every key and its shape are checked and named.
inline BnbNf4Weight read_bnb_nf4(const SafetensorsCheckpoint& ck, const std::string& module) {
  const std::string w = module + ".weight";
  const auto need = [&](const std::string& name, DType d, std::vector<std::int64_t> shape) {
    check(ck.contains(name), "bitsandbytes NF4: tensor '" + name + "' is missing");
    const auto& t = ck.info(name);
    check(t.dtype == d, "bitsandbytes NF4: tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) + ", expected " +
                            std::string(dtype_name(d)));
    if (!shape.empty())
      check(t.shape == shape, "bitsandbytes NF4: tensor '" + name + "' is " + shape_string(t.shape) + ", expected " + shape_string(shape));
    return name;
  };
  const auto key = w + "." + kBnbNf4StateKey;
  const auto blob = ck.read<std::uint8_t>(need(key, DType::U8, {}), DType::U8);
  BnbNf4Weight b;
  b.info = decode_quant_state(std::string(blob.begin(), blob.end()), key);
  const std::int64_t bytes = kernels::quant::nf4_code_bytes(b.numel()), blocks = b.blocks();
  b.codes = ck.read<std::uint8_t>(need(w, DType::U8, {bytes, 1}), DType::U8);
  const auto qmap = ck.read<float>(need(w + ".quant_map", DType::F32, {16}), DType::F32);
  for (int c = 0; c < 16; ++c)
    check(qmap[c] == kernels::quant::nf4_code_value(c),
          "bitsandbytes NF4: tensor '" + w + ".quant_map' is not the NF4 table (entry " + std::to_string(c) + ")");
  if (!b.info.nested) {
    b.absmax = ck.read<float>(need(w + ".absmax", DType::F32, {blocks}), DType::F32);
    return b;
  }
  b.absmax_codes = ck.read<std::uint8_t>(need(w + ".absmax", DType::U8, {blocks}), DType::U8);
  const std::int64_t groups = (blocks + b.info.nested_blocksize - 1) / b.info.nested_blocksize;
  b.nested_absmax = ck.read<float>(need(w + ".nested_absmax", DType::F32, {groups}), DType::F32);
  // the file's own map decodes its codes (bitsandbytes does the same), whatever float rounding made it
  b.nested_quant_map = ck.read<float>(need(w + ".nested_quant_map", DType::F32, {256}), DType::F32);
  return b;
}

}  // namespace squeeze::io
