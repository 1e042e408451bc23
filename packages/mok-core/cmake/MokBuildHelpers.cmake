# Build settings shared by the mok compiled packages: the MOK_CUDA switch, flags, build facts.
#
# mok-core includes this file from its source tree (its own build and the top-level superbuild);
# mok-bf16 and mok-mxfp8 get the installed copy through find_package(MokCore), so all three
# packages resolve CUDA and set their determinism flags the same way.
include_guard(GLOBAL)

# Reads `version = "X.Y.Z"` from a pyproject.toml: each package writes its version only there.
function(mok_read_pyproject_version pyproject out_var)
  file(STRINGS "${pyproject}" _line REGEX "^version *=" LIMIT_COUNT 1)
  string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" _version "${_line}")
  if(NOT _version)
    message(FATAL_ERROR "no `version = \"X.Y.Z\"` line in ${pyproject}")
  endif()
  set(${out_var}
      "${_version}"
      PARENT_SCOPE)
endfunction()

# Defines mok-core's header-only target mok_core_headers (alias MokCore::headers) from mok-core's
# source tree, generating mok/core/version.h under <binary_dir>/include. mok-core's own build
# uses it, and so does a precision package built from a checkout, against the mok-core beside it.
# Sets MokCore_VERSION in the caller.
function(mok_add_core_headers_target core_source_dir binary_dir)
  cmake_parse_arguments(PARSE_ARGV 2 arg "" "INSTALL_INCLUDEDIR" "")
  get_filename_component(core_source_dir "${core_source_dir}" ABSOLUTE)
  mok_read_pyproject_version("${core_source_dir}/pyproject.toml" MOK_CORE_VERSION)
  string(REPLACE "." ";" _parts "${MOK_CORE_VERSION}")
  list(GET _parts 0 MOK_CORE_VERSION_MAJOR)
  list(GET _parts 1 MOK_CORE_VERSION_MINOR)
  list(GET _parts 2 MOK_CORE_VERSION_PATCH)
  configure_file("${core_source_dir}/include/mok/core/version.h.in"
                 "${binary_dir}/include/mok/core/version.h" @ONLY)

  add_library(mok_core_headers INTERFACE)
  add_library(MokCore::headers ALIAS mok_core_headers)
  set_target_properties(mok_core_headers PROPERTIES EXPORT_NAME headers)
  target_include_directories(
    mok_core_headers INTERFACE $<BUILD_INTERFACE:${core_source_dir}/include>
                               $<BUILD_INTERFACE:${binary_dir}/include>)
  if(arg_INSTALL_INCLUDEDIR)
    target_include_directories(mok_core_headers
                               INTERFACE $<INSTALL_INTERFACE:${arg_INSTALL_INCLUDEDIR}>)
  endif()
  target_compile_features(mok_core_headers INTERFACE cxx_std_17)
  set(MokCore_VERSION
      "${MOK_CORE_VERSION}"
      PARENT_SCOPE)
endfunction()

# Defaults an unset single-config build type to Release (scikit-build-core passes its own).
macro(mok_default_build_type)
  get_property(_mok_multi_config GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
  if(NOT _mok_multi_config AND NOT CMAKE_BUILD_TYPE)
    set(CMAKE_BUILD_TYPE
        Release
        CACHE STRING "Build type" FORCE)
  endif()
endmacro()

# Resolves MOK_CUDA (AUTO|ON|OFF) into MOK_WITH_CUDA (ON/OFF) and enables the CUDA language.
#
# The cache variable wins; when it was never given, the environment variable MOK_CUDA sets its
# first value, so `MOK_CUDA=OFF pip install ...` works. A macro rather than a function because
# enable_language() must run at the calling directory's file scope. In a tree of several
# packages, call it in the top directory first: CUDA must be enabled above every target using it.
macro(mok_enable_cuda)
  if(NOT DEFINED MOK_CUDA)
    if(NOT "$ENV{MOK_CUDA}" STREQUAL "")
      set(_mok_cuda_initial "$ENV{MOK_CUDA}")
    else()
      set(_mok_cuda_initial AUTO)
    endif()
    set(MOK_CUDA
        "${_mok_cuda_initial}"
        CACHE STRING "Compile CUDA sources: AUTO (if nvcc is found), ON (nvcc required) or OFF")
    set_property(CACHE MOK_CUDA PROPERTY STRINGS AUTO ON OFF)
  endif()

  string(TOUPPER "${MOK_CUDA}" _mok_cuda_mode)
  if(_mok_cuda_mode MATCHES "^(ON|1|TRUE|YES)$")
    set(_mok_cuda_mode ON)
  elseif(_mok_cuda_mode MATCHES "^(OFF|0|FALSE|NO)$")
    set(_mok_cuda_mode OFF)
  elseif(NOT _mok_cuda_mode STREQUAL "AUTO")
    message(FATAL_ERROR "MOK_CUDA must be AUTO, ON or OFF, got '${MOK_CUDA}'")
  endif()

  set(MOK_WITH_CUDA OFF)
  if(NOT _mok_cuda_mode STREQUAL "OFF")
    get_property(_mok_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
    if(NOT "CUDA" IN_LIST _mok_languages)
      include(CheckLanguage)
      check_language(CUDA)
      if(CMAKE_CUDA_COMPILER)
        # Hopper by default: wgmma and the async tensor-memory instructions need sm_90a, which
        # the compiler's own default architecture never is. CUDAARCHS or -D override it.
        if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND "$ENV{CUDAARCHS}" STREQUAL "")
          set(CMAKE_CUDA_ARCHITECTURES
              90a
              CACHE STRING "CUDA architectures to compile for")
        endif()
        enable_language(CUDA)
      endif()
      get_property(_mok_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
    endif()
    if("CUDA" IN_LIST _mok_languages)
      set(MOK_WITH_CUDA ON)
      find_package(CUDAToolkit REQUIRED)
    elseif(_mok_cuda_mode STREQUAL "ON")
      message(FATAL_ERROR "MOK_CUDA=ON but no CUDA compiler was found: put nvcc on PATH, "
                          "set CUDACXX, or build with MOK_CUDA=AUTO or OFF")
    endif()
  endif()
  get_property(_mok_cuda_reported GLOBAL PROPERTY MOK_CUDA_REPORTED)
  if(NOT _mok_cuda_reported)
    set_property(GLOBAL PROPERTY MOK_CUDA_REPORTED TRUE)
    if(MOK_WITH_CUDA)
      message(STATUS "mok: MOK_CUDA=${MOK_CUDA}: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, "
                     "architectures ${CMAKE_CUDA_ARCHITECTURES}")
    else()
      message(STATUS "mok: MOK_CUDA=${MOK_CUDA}: CPU only")
    endif()
  endif()
endmacro()

# Finds Python's development module files and pybind11, unless a parent directory already did.
# pybind11 comes from CMAKE_PREFIX_PATH (scikit-build-core adds site-packages), else from
# `python -m pybind11 --cmakedir` of the Python found.
macro(mok_find_python_and_pybind11)
  if(NOT TARGET pybind11::module)
    find_package(Python 3.10 REQUIRED COMPONENTS Interpreter Development.Module)
    set(PYBIND11_FINDPYTHON ON)
    find_package(pybind11 CONFIG QUIET)
    if(NOT pybind11_FOUND)
      execute_process(
        COMMAND "${Python_EXECUTABLE}" -m pybind11 --cmakedir
        OUTPUT_VARIABLE _mok_pybind11_dir
        OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      find_package(pybind11 CONFIG REQUIRED HINTS "${_mok_pybind11_dir}")
    endif()
  endif()
endmacro()

# Applies the flags every mok compiled target needs.
#
# -ffp-contract=off: the host compiler must not fuse a*b+c into an FMA. GCC does so by default
# wherever the target has FMA (aarch64 always, x86-64 with -march flags), which would make the
# CPU backend's bits depend on the machine. Device code keeps nvcc's defaults: its contraction
# is fixed at compile time, so it is deterministic for a given build.
function(mok_configure_target target)
  target_compile_features(${target} PRIVATE cxx_std_17)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off -Wall
                                             -Wextra>)
  endif()
  if(MOK_WITH_CUDA)
    target_compile_features(${target} PRIVATE cuda_std_17)
    set_target_properties(${target} PROPERTIES CUDA_EXTENSIONS OFF)
    target_compile_options(${target}
                           PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-ffp-contract=off>)
    target_compile_definitions(${target} PRIVATE MOK_WITH_CUDA=1)
    target_link_libraries(${target} PRIVATE CUDA::cudart_static)
  else()
    target_compile_definitions(${target} PRIVATE MOK_WITH_CUDA=0)
  endif()
endfunction()

# Writes <binary dir>/generated/mok_build_config.h with the facts build_info() reports, and puts
# it on the target's private include path.
function(mok_add_build_config target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "PACKAGE;VERSION" "")
  set(MOK_BUILD_PACKAGE "${arg_PACKAGE}")
  set(MOK_BUILD_VERSION "${arg_VERSION}")
  set(MOK_BUILD_CXX_COMPILER "${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}")
  if(MOK_WITH_CUDA)
    set(MOK_BUILD_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
    set(MOK_BUILD_CUDA_COMPILER_VERSION "${CMAKE_CUDA_COMPILER_VERSION}")
  else()
    set(MOK_BUILD_CUDA_ARCHITECTURES "")
    set(MOK_BUILD_CUDA_COMPILER_VERSION "")
  endif()
  set(_dir "${CMAKE_CURRENT_BINARY_DIR}/generated")
  file(
    CONFIGURE
    OUTPUT "${_dir}/mok_build_config.h"
    CONTENT
      "// Generated by mok_add_build_config(): facts about this build of @MOK_BUILD_PACKAGE@.
#pragma once
#define MOK_BUILD_PACKAGE \"@MOK_BUILD_PACKAGE@\"
#define MOK_BUILD_VERSION \"@MOK_BUILD_VERSION@\"
#define MOK_BUILD_CXX_COMPILER \"@MOK_BUILD_CXX_COMPILER@\"
// A CMake list (\"90a;100a\"), empty without CUDA.
#define MOK_BUILD_CUDA_ARCHITECTURES \"@MOK_BUILD_CUDA_ARCHITECTURES@\"
// Empty without CUDA.
#define MOK_BUILD_CUDA_COMPILER_VERSION \"@MOK_BUILD_CUDA_COMPILER_VERSION@\"
"
    @ONLY)
  target_include_directories(${target} PRIVATE "${_dir}")
  # A definition, not part of the header, so that multi-config generators report each config.
  target_compile_definitions(${target} PRIVATE "MOK_BUILD_TYPE=\"$<CONFIG>\"")
endfunction()
