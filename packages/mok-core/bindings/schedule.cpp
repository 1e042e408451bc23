// Python bindings of the schedule table and the send side (docs/core-runtime.md "Schedule").
#include <cstdint>
#include <string>

#include "mok/core/schedule.h"
#include "register.h"
#include "schedule_impl.h"

namespace mok::core::bindings {

void register_schedule(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "schedule_capacity",
      [](std::int64_t world_size, std::int64_t max_tokens, std::int64_t topk,
         std::int64_t num_local_experts, std::int64_t alignment) {
        return checked_schedule_capacity("schedule_capacity", world_size, max_tokens, topk,
                                         num_local_experts, alignment);
      },
      py::arg("world_size"), py::arg("max_tokens"), py::arg("topk"), py::arg("num_local_experts"),
      py::arg("alignment"),
      "Worst-case rows of the schedule table: align_up(R * max_tokens * K + El * (alignment - 1), "
      "alignment). Raises ValueError for a bad argument or a table past 2^31 - 1 rows.");

  m.def(
      "build_table",
      [](const std::string& device, std::uintptr_t routes_ptrs, std::uintptr_t tokens_ptrs,
         std::int64_t world_size, std::int64_t max_tokens, std::int64_t topk, std::int64_t rank,
         std::int64_t num_local_experts, std::int64_t alignment, std::int64_t capacity,
         std::uintptr_t row_src_rank, std::uintptr_t row_route, std::uintptr_t expert_offsets,
         std::uintptr_t expert_counts, std::uintptr_t recv_counts, std::uintptr_t tokens_per_rank,
         std::uintptr_t stream, std::uintptr_t route_row_ptrs, std::uintptr_t scratch,
         std::uintptr_t error, bool local_routes, std::uintptr_t routes, bool routes_int64,
         std::int64_t num_tokens, std::uintptr_t route_row, std::uintptr_t routes_copy) {
        TableArgs a;
        a.routes_ptrs = routes_ptrs;
        a.tokens_ptrs = tokens_ptrs;
        a.world_size = world_size;
        a.max_tokens = max_tokens;
        a.topk = topk;
        a.rank = rank;
        a.num_local_experts = num_local_experts;
        a.alignment = alignment;
        a.capacity = capacity;
        a.row_src_rank = row_src_rank;
        a.row_route = row_route;
        a.expert_offsets = expert_offsets;
        a.expert_counts = expert_counts;
        a.recv_counts = recv_counts;
        a.tokens_per_rank = tokens_per_rank;
        a.route_row_ptrs = route_row_ptrs;
        a.scratch = scratch;
        a.error = error;
        a.local_routes = local_routes;
        a.routes = routes;
        a.routes_int64 = routes_int64;
        a.num_tokens = num_tokens;
        a.route_row = route_row;
        a.routes_copy = routes_copy;
        build_table(device, a, stream);
      },
      py::arg("device"), py::arg("routes_ptrs"), py::arg("tokens_ptrs"), py::arg("world_size"),
      py::arg("max_tokens"), py::arg("topk"), py::arg("rank"), py::arg("num_local_experts"),
      py::arg("alignment"), py::arg("capacity"), py::arg("row_src_rank"), py::arg("row_route"),
      py::arg("expert_offsets"), py::arg("expert_counts"), py::arg("recv_counts"),
      py::arg("tokens_per_rank"), py::arg("stream") = 0, py::arg("route_row_ptrs") = 0,
      py::arg("scratch") = 0, py::arg("error") = 0, py::arg("local_routes") = false,
      py::arg("routes") = 0, py::arg("routes_int64") = false, py::arg("num_tokens") = 0,
      py::arg("route_row") = 0, py::arg("routes_copy") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "The schedule table of `rank` from every rank's routes. routes_ptrs / tokens_ptrs: address "
      "of an int64 [R] array of pointers to rank s's int32 [max_tokens, K] routes / int64 token "
      "count (host memory on \"cpu\", device memory on \"cuda\"). Writes row_src_rank, row_route "
      "(int32 [capacity], -1 = padding), expert_offsets (int32 [El + 1]), expert_counts (int32 "
      "[El]), recv_counts and tokens_per_rank (int64 [R]). Bitwise the reference's "
      "table_from_routes. On \"cuda\" it is enqueued on `stream` and never waits for the host. "
      "route_row_ptrs (optional): address of an int64 [R] array of pointers to rank s's int32 "
      "[max_tokens * K] array, which gets each of its routes' rows in this table. scratch "
      "(optional, \"cuda\"): schedule_scratch_bytes(...) bytes of device memory; given, many CTAs "
      "build the table (two kernels, the same bits), else one. error (optional): address of the "
      "transport's int32 [4] error words (8-byte aligned); an expert id outside [0, R * El) routes "
      "nowhere, and the first such route (smallest source rank, then route index) is recorded "
      "there: code 3, words 2-3 as one uint64 whose high half is INT32_MAX - (s * max_tokens * K "
      "+ i) and whose low half is the id. local_routes (world_size 1 only): `routes` is the "
      "address "
      "of this rank's routes [num_tokens, K] (int32, or int64 with routes_int64), read in place "
      "instead of through routes_ptrs / tokens_ptrs (then ignored, may be 0); route_row the "
      "address "
      "of an int32 [num_tokens * K] array for each route's row (0: not written; route_row_ptrs "
      "must "
      "be 0); routes_copy the address of an int32 [num_tokens * K] array for each route's id as "
      "read (0: not written), written by the counting pass (no copy kernel). An int64 id outside "
      "int32 reads as the nearest int32 (a bad id, never a valid one).");

  m.def(
      "build_send_side",
      [](const std::string& device, std::uintptr_t top_experts, std::int64_t num_tokens,
         std::int64_t topk, std::int64_t num_local_experts, std::int64_t world_size,
         std::uintptr_t send_order, std::uintptr_t send_counts, std::uintptr_t stream,
         std::uintptr_t scratch) {
        SendSideArgs a;
        a.top_experts = top_experts;
        a.num_tokens = num_tokens;
        a.topk = topk;
        a.num_local_experts = num_local_experts;
        a.world_size = world_size;
        a.send_order = send_order;
        a.send_counts = send_counts;
        a.scratch = scratch;
        build_send_side(device, a, stream);
      },
      py::arg("device"), py::arg("top_experts"), py::arg("num_tokens"), py::arg("topk"),
      py::arg("num_local_experts"), py::arg("world_size"), py::arg("send_order"),
      py::arg("send_counts"), py::arg("stream") = 0, py::arg("scratch") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "This rank's routes (int32 [T, K] global expert ids) sorted stably by expert: send_order "
      "(int64 [T*K]) gets the route indices t*K + k, send_counts (int64 [R]) the routes to each "
      "rank's experts. Bitwise the reference's send_side for ids in [0, R*El). scratch: as for "
      "build_table.");

  m.def(
      "schedule_scratch_bytes",
      [](std::int64_t world_size, std::int64_t max_tokens, std::int64_t topk,
         std::int64_t num_local_experts) {
        checked_schedule_capacity("schedule_scratch_bytes", world_size, max_tokens, topk,
                                  num_local_experts, 1);
        return schedule_scratch_bytes(world_size, max_tokens, topk, num_local_experts);
      },
      py::arg("world_size"), py::arg("max_tokens"), py::arg("topk"), py::arg("num_local_experts"),
      "Bytes of the scratch buffer that lets build_table and build_send_side run on many CTAs on "
      "\"cuda\" (one count per chunk of routes and bucket).");
}

}  // namespace mok::core::bindings
