#pragma once
// The quantized model file (GPTQ weights as AutoGPTQ / GPTQModel write them): a directory with
//   model.safetensors      <layer>.qweight I32, <layer>.qzeros I32, <layer>.scales F16, <layer>.g_idx I32,
//                          <layer>.bias F16 (optional), plus any unquantized tensors passed through
//   quantize_config.json   {"bits", "group_size" (-1 = per channel), "desc_act", "sym", "static_groups",
//                           "damp_percent", "true_sequential", "quant_method": "gptq", "checkpoint_format": "gptq"}
// Loading checks the config against every layer's tensor shapes and names what disagrees.
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "squeeze/io/json_file.hpp"
#include "squeeze/io/safetensors.hpp"
#include "squeeze/quant/pack.hpp"
#include "squeeze/quant/v1_zeros.hpp"

namespace squeeze::io {

using quant::PackedLinear;

struct QuantizeConfig {
  int bits = 4;
  int group_size = 128;  // 0 here = per channel (-1 in the file)
  bool desc_act = false;
  bool sym = true;
  bool static_groups = false;
  double damp_percent = 0.01;
  bool true_sequential = true;
};

struct QuantizedModelFile {
  QuantizeConfig config;
  std::map<std::string, PackedLinear> layers;
  io::SafetensorsFile file;  // everything, including unquantized tensors (embeddings, norms, ...)
};

// quantize_config.json as AutoGPTQ / GPTQModel write it; config.json's "quantization_config" holds the same
// keys (transformers' GPTQConfig reads bits, group_size, desc_act, sym, checkpoint_format from either).
inline nlohmann::json quantize_config_json(const QuantizeConfig& cfg) {
  quant::check_bits(cfg.bits);
  return {{"bits", cfg.bits},
          {"group_size", cfg.group_size > 0 ? cfg.group_size : -1},
          {"desc_act", cfg.desc_act},
          {"sym", cfg.sym},
          {"static_groups", cfg.static_groups},
          {"damp_percent", cfg.damp_percent},
          {"true_sequential", cfg.true_sequential},
          {"quant_method", "gptq"},
          {"checkpoint_format", "gptq"},
          {"format", "gptq"}};
}

// The inverse of quantize_config_json; errors start with `source` and name the key.
inline QuantizeConfig parse_quantize_config(const nlohmann::json& j, const std::string& source) {
  check(!j.is_discarded() && j.is_object(), source + ": is not a JSON object");
  auto get_int = [&](const char* k) {
    check(j.contains(k) && j[k].is_number_integer(), source + ": '" + k + "' must be an integer");
    return j[k].get<std::int64_t>();
  };
  auto get_bool = [&](const char* k, bool def) {
    if (!j.contains(k) || j[k].is_null()) return def;
    check(j[k].is_boolean(), source + ": '" + k + "' must be true or false");
    return j[k].get<bool>();
  };
  if (j.contains("quant_method")) {
    check(j["quant_method"].is_string(), source + ": 'quant_method' must be a string");
    const auto m = j["quant_method"].get<std::string>();
    check(m == "gptq", source + ": quant_method '" + m + "' is not supported (this reader takes 'gptq')");
  }
  QuantizeConfig c;
  const auto bits = get_int("bits");
  check(quant::supported_bits(int(bits)), source + ": bits " + std::to_string(bits) + " unsupported (2, 3, 4 or 8)");
  c.bits = int(bits);
  const auto g = get_int("group_size");
  check(g == -1 || (g > 0 && g <= (1 << 30)), source + ": group_size must be -1 or positive, got " + std::to_string(g));
  c.group_size = g > 0 ? int(g) : 0;
  c.desc_act = get_bool("desc_act", false);
  c.sym = get_bool("sym", true);
  c.static_groups = get_bool("static_groups", false);
  c.true_sequential = get_bool("true_sequential", true);
  if (j.contains("damp_percent") && j["damp_percent"].is_number()) c.damp_percent = j["damp_percent"].get<double>();
  for (const char* k : {"checkpoint_format", "format"})
    if (j.contains(k) && !j[k].is_null()) {
      check(j[k].is_string(), source + ": '" + k + "' must be a string");
      const auto fmt = j[k].get<std::string>();
      check(fmt == "gptq", source + ": " + std::string(k) + " '" + fmt +
                               "' is not supported; this reader takes the v1 'gptq' format (zero points stored minus one)");
    }
  return c;
}

inline void save_quantized(const std::filesystem::path& dir, const std::map<std::string, PackedLinear>& layers, const QuantizeConfig& cfg,
                           const std::map<std::string, io::TensorRef>& extra = {}) {
  quant::check_bits(cfg.bits);
  std::filesystem::create_directories(dir);
  std::map<std::string, io::TensorRef> t = extra;
  std::map<std::string, std::vector<std::int32_t>> file_qzeros;  // v1 word-wise, as GPTQModel reads them back
  for (const auto& [name, p] : layers) {
    p.validate();
    file_qzeros[name] = qzeros_from_packed(p, quant::ZeroArithmetic::word);
    check(p.bits == cfg.bits && p.group_size == cfg.group_size,
          "save_quantized: layer '" + name + "' has bits " + std::to_string(p.bits) + " group " + std::to_string(p.group_size) +
              " but the config says bits " + std::to_string(cfg.bits) + " group " + std::to_string(cfg.group_size));
    t[name + ".qweight"] = io::tensor_ref<std::int32_t>(io::DType::I32, {p.qweight_rows(), p.out}, p.qweight);
    t[name + ".qzeros"] = io::tensor_ref<std::int32_t>(io::DType::I32, {p.groups(), p.qzeros_cols()}, file_qzeros.at(name));
    t[name + ".scales"] = io::tensor_ref<half>(io::DType::F16, {p.groups(), p.out}, p.scales);
    t[name + ".g_idx"] = io::tensor_ref<std::int32_t>(io::DType::I32, {p.in}, p.g_idx);
    if (!p.bias.empty()) t[name + ".bias"] = io::tensor_ref<half>(io::DType::F16, {p.out}, p.bias);
  }
  io::save_safetensors(dir / "model.safetensors", t, {{"format", "pt"}, {"quantizer", "squeeze"}});
  io::save_json(dir / "quantize_config.json", quantize_config_json(cfg), "save_quantized");
}

inline QuantizeConfig read_quantize_config(const std::filesystem::path& path) {
  std::ifstream f(path);
  check(bool(f), "quantize_config.json: cannot open " + path.string());
  return parse_quantize_config(nlohmann::json::parse(f, nullptr, false), "quantize_config.json");
}

inline QuantizedModelFile load_quantized(const std::filesystem::path& dir) {
  QuantizedModelFile ck;
  ck.config = read_quantize_config(dir / "quantize_config.json");
  ck.file = io::SafetensorsFile::open(dir / "model.safetensors");
  const auto& cfg = ck.config;
  const std::string suffix = ".qweight";
  for (const auto& [tname, info] : ck.file.tensors()) {
    if (tname.size() <= suffix.size() || tname.compare(tname.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string name = tname.substr(0, tname.size() - suffix.size());
    auto need = [&](const std::string& part) {
      check(ck.file.contains(name + part), "quantized model file: layer '" + name + "' has a qweight but no '" + name + part + "'");
      return ck.file.info(name + part);
    };
    const auto qz = need(".qzeros"), sc = need(".scales"), gi = need(".g_idx");
    auto rank = [&](const io::TensorInfo& t, std::size_t r, const std::string& part) {
      check(t.shape.size() == r, "quantized model file: " + name + part + " must have rank " + std::to_string(r));
    };
    rank(info, 2, ".qweight");
    rank(qz, 2, ".qzeros");
    rank(sc, 2, ".scales");
    rank(gi, 1, ".g_idx");
    PackedLinear p;
    p.bits = cfg.bits;
    p.group_size = cfg.group_size;
    p.in = gi.shape[0];
    p.out = info.shape[1];
    const auto mismatch = [&](const std::string& what) {
      throw Error("quantized model file: layer '" + name + "': " + what + " (quantize_config.json: bits " + std::to_string(cfg.bits) +
                  ", group_size " + std::to_string(cfg.group_size > 0 ? cfg.group_size : -1) + ")");
    };
    if (p.in <= 0 || p.out <= 0) mismatch("empty layer");
    if (info.shape[0] != p.qweight_rows())
      mismatch("qweight has " + std::to_string(info.shape[0]) + " rows; " + std::to_string(p.in) + " inputs at " +
               std::to_string(cfg.bits) + " bits need " + std::to_string(p.qweight_rows()) + " - the bit width does not match the tensors");
    if (sc.shape[0] != p.groups() || sc.shape[1] != p.out)
      mismatch("scales are [" + std::to_string(sc.shape[0]) + ", " + std::to_string(sc.shape[1]) + "], expected [" +
               std::to_string(p.groups()) + ", " + std::to_string(p.out) + "] - the group size does not match the tensors");
    if (qz.shape[0] != p.groups() || qz.shape[1] != p.qzeros_cols())
      mismatch("qzeros are [" + std::to_string(qz.shape[0]) + ", " + std::to_string(qz.shape[1]) + "], expected [" +
               std::to_string(p.groups()) + ", " + std::to_string(p.qzeros_cols()) + "]");
    p.qweight = ck.file.read<std::int32_t>(name + ".qweight", io::DType::I32);
    p.qzeros = quant::qzeros_to_packed(ck.file.read<std::int32_t>(name + ".qzeros", io::DType::I32), p.groups(), p.out, p.bits,
                                       quant::ZeroArithmetic::word);  // a zero point of 0 borrows in the file (quant/v1_zeros.hpp)
    p.scales = ck.file.read<half>(name + ".scales", io::DType::F16);
    p.g_idx = ck.file.read<std::int32_t>(name + ".g_idx", io::DType::I32);
    if (ck.file.contains(name + ".bias")) {
      const auto& b = ck.file.info(name + ".bias");
      check(b.shape.size() == 1 && b.shape[0] == p.out, "quantized model file: " + name + ".bias must be [" + std::to_string(p.out) + "]");
      p.bias = ck.file.read<half>(name + ".bias", io::DType::F16);
    }
    try {
      p.validate();
    } catch (const Error& e) {
      mismatch(e.what());
    }
    ck.layers[name] = std::move(p);
  }
  check(!ck.layers.empty(), "quantized model file: " + (dir / "model.safetensors").string() + " holds no '*.qweight' tensors");
  return ck;
}

}  // namespace squeeze::io
