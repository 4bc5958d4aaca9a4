#pragma once
// Small JSON files written whole (config.json, model.safetensors.index.json, adapter_config.json): through a
// temporary file renamed into place, so a failed write never leaves a half file where an old one was.
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "squeeze/error.hpp"

namespace squeeze::io {

// Writes `j` indented to "<file>.tmp", then renames it over `file`. Errors start with `who`.
inline void save_json(const std::filesystem::path& file, const nlohmann::json& j, std::string_view who) {
  const auto tmp = std::filesystem::path(file.string() + ".tmp");
  {
    std::ofstream f(tmp, std::ios::trunc);
    check(bool(f), std::string(who) + ": cannot write " + tmp.string());
    f << j.dump(2) << "\n";
    f.flush();
    check(bool(f), std::string(who) + ": writing " + tmp.string() + " failed (disk full?)");
  }
  std::filesystem::rename(tmp, file);
}

}  // namespace squeeze::io
