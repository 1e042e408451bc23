// BuildInfo: what a mok compiled package was built with, reported alike by all of them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mok::core {

struct BuildInfo {
  std::string package;           // distribution name, e.g. "mok-bf16"
  std::string version;           // that package's version
  std::string mok_core_version;  // version of the mok-core headers it was compiled against
  bool cuda = false;             // whether CUDA sources were compiled in
  std::vector<std::string> cuda_architectures;  // e.g. {"90a"}; empty without CUDA
  std::string cuda_compiler_version;            // e.g. "13.0.88"; empty without CUDA
  int cuda_runtime_version = 0;  // statically linked CUDA runtime, e.g. 13000; 0 without CUDA
  std::string cxx_compiler;      // compiler id and version, e.g. "GNU 12.2.0"
  std::string build_type;        // e.g. "Release"

  // Device kinds compiled in: always "cpu", then "cuda" when CUDA was compiled.
  std::vector<std::string> backends() const {
    std::vector<std::string> kinds{"cpu"};
    if (cuda) kinds.emplace_back("cuda");
    return kinds;
  }
};

// Splits a CMake list ("90a;100a") into its non-empty items.
inline std::vector<std::string> split_cmake_list(std::string_view list) {
  std::vector<std::string> items;
  while (!list.empty()) {
    const std::size_t end = list.find(';');
    const std::string_view item = list.substr(0, end);
    if (!item.empty()) items.emplace_back(item);
    if (end == std::string_view::npos) break;
    list.remove_prefix(end + 1);
  }
  return items;
}

}  // namespace mok::core
