// Python bindings of the transport: pull_rows, push_rows, barrier, ErrorMirror and ShmSegment.
#include <Python.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "register.h"
#include "shm.h"
#include "transport.h"

namespace mok::core::bindings {

void register_transport(pybind11::module_& m) {
  namespace py = pybind11;

  // A failed system call on a segment is an OSError(errno, message, name): Python picks the
  // subclass from errno (FileNotFoundError for a missing segment, FileExistsError, ...).
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ShmError& e) {
      py::object error = py::reinterpret_borrow<py::object>(PyExc_OSError)(
          e.code().value(), std::string(e.what()), e.name());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    }
  });

  m.def(
      "pull_rows",
      [](const std::string& device, std::int64_t dst, std::int64_t src_ptrs,
         std::int64_t row_src_rank, std::int64_t row_route, std::int64_t capacity,
         std::int64_t route_divisor, std::int64_t row_bytes, std::int64_t src_stride,
         std::int64_t dst_stride, std::int64_t num_workers, std::int64_t stream) {
        pull_rows(parse_transport_device(device), dst, src_ptrs, row_src_rank, row_route, capacity,
                  route_divisor, row_bytes, src_stride, dst_stride, num_workers, stream);
      },
      py::arg("device"), py::arg("dst"), py::arg("src_ptrs"), py::arg("row_src_rank"),
      py::arg("row_route"), py::arg("capacity"), py::arg("route_divisor"), py::arg("row_bytes"),
      py::arg("src_stride"), py::arg("dst_stride"), py::arg("num_workers"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Pull the schedule table's rows from the source ranks (docs/core-runtime.md). For each "
      "table row i < capacity: if row_src_rank[i] >= 0, copy row_bytes from "
      "src_ptrs[row_src_rank[i]] + (row_route[i] // route_divisor) * src_stride to "
      "dst + i * dst_stride, else zero-fill it (the rest of each stride is not touched). "
      "Pointers are ints; src_ptrs is the address of an int64 array of per-rank addresses "
      "(host memory for 'cpu', device memory for 'cuda'); row_src_rank and row_route are int32 "
      "[capacity]. num_workers: threads on the CPU, CTAs on the GPU. On 'cuda' the copy is "
      "enqueued on `stream` and never synchronised. Raises ValueError naming a bad argument, "
      "RuntimeError for 'cuda' on a build without CUDA or a failed launch.");

  m.def(
      "push_rows",
      [](const std::string& device, std::int64_t src, std::int64_t dst_ptrs,
         std::int64_t row_src_rank, std::int64_t row_route, std::int64_t capacity,
         std::int64_t row_bytes, std::int64_t src_stride, std::int64_t dst_stride,
         std::int64_t num_workers, std::int64_t stream, std::int64_t src_divisor,
         std::int64_t dst_local) {
        push_rows(parse_transport_device(device), src, dst_ptrs, row_src_rank, row_route, capacity,
                  row_bytes, src_stride, dst_stride, num_workers, stream, src_divisor, dst_local);
      },
      py::arg("device"), py::arg("src"), py::arg("dst_ptrs"), py::arg("row_src_rank"),
      py::arg("row_route"), py::arg("capacity"), py::arg("row_bytes"), py::arg("src_stride"),
      py::arg("dst_stride"), py::arg("num_workers"), py::arg("stream") = 0,
      py::arg("src_divisor") = 1, py::arg("dst_local") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Push rows to other ranks (docs/core-runtime.md). For each i < capacity with "
      "row_src_rank[i] >= 0, copy row_bytes from src + (i // src_divisor) * src_stride to "
      "dst_ptrs[row_src_rank[i]] + row_route[i] * dst_stride (one destination row per i; "
      "i with row_src_rank[i] < 0 are skipped). An expert rank pushes its table rows back to "
      "their routes (src_divisor 1: the push combine); a source rank pushes each token's row "
      "to its routes' rows in the expert ranks' tables (src_divisor K: the push dispatch). "
      "dst_local (with dst_ptrs 0): the address of this process's destination rows instead, "
      "for the i with row_src_rank[i] == 0 (others skipped): one rank's scatter of its token "
      "rows into table order, each token row read once for its routes. "
      "Arguments as in pull_rows.");

  m.def(
      "zero_rows",
      [](const std::string& device, std::int64_t dst, std::int64_t row_src_rank,
         std::int64_t capacity, std::int64_t row_bytes, std::int64_t dst_stride,
         std::int64_t num_workers, std::int64_t stream) {
        zero_rows(parse_transport_device(device), dst, row_src_rank, capacity, row_bytes,
                  dst_stride, num_workers, stream);
      },
      py::arg("device"), py::arg("dst"), py::arg("row_src_rank"), py::arg("capacity"),
      py::arg("row_bytes"), py::arg("dst_stride"), py::arg("num_workers"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "Zero-fill the padding rows of a table (docs/core-runtime.md): row_bytes at "
      "dst + i * dst_stride for each i < capacity with row_src_rank[i] < 0; other rows are not "
      "touched. What a pull does for padding rows, for tables whose rows were pushed. "
      "Arguments as in pull_rows.");

  m.def(
      "barrier",
      [](const std::string& device, std::int64_t epoch, std::int64_t signal_pad_ptrs,
         std::int64_t rank, std::int64_t world_size, std::int64_t error, std::int64_t stage,
         std::int64_t timeout_ns, std::int64_t stream) {
        return barrier(parse_transport_device(device), epoch, signal_pad_ptrs, rank, world_size,
                       error, stage, timeout_ns, stream);
      },
      py::arg("device"), py::arg("epoch"), py::arg("signal_pad_ptrs"), py::arg("rank"),
      py::arg("world_size"), py::arg("error"), py::arg("stage"), py::arg("timeout_ns"),
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "Epoch barrier over the group (docs/core-runtime.md). epoch: address of this rank's uint64 "
      "counter (local memory); signal_pad_ptrs: address of an int64 array of the ranks' pad "
      "addresses, each pad world_size uint64 slots (shared memory, zero at the start); error: "
      "address of int32 [4] (code, peer, stage, rank); stage: the barrier's tag in [0, 2^24), "
      "the same on every rank in step (the caller's stage and call). Increments the epoch to e, "
      "stores (e, stage) into slot `rank` of every pad (release, system scope), then waits until "
      "every slot of its own pad holds an epoch >= e (acquire): a peer at e with the same stage, "
      "or at e + 1, is in step. A wait longer than timeout_ns writes error = (1, the missing peer, "
      "stage, rank), a peer at another barrier error = (2, that peer, stage, rank), and the call "
      "gives up; a set error is sticky: later calls still arrive but never wait. "
      "On 'cpu' it blocks (without the GIL) and returns False on error; on 'cuda' it enqueues one "
      "kernel on `stream` and returns True (the outcome lands in `error`).");

  py::class_<ErrorMirror>(
      m, "ErrorMirror",
      "ErrorMirror(device): the transport's error words as the host sees them "
      "(docs/core-runtime.md): "
      "four words of host memory that a call's last step copies the device's words into, behind "
      "its work, for the host to read at any time with no copy or event of its own. On 'cuda' "
      "pinned memory mapped into the device's address space (made here: not inside a CUDA graph "
      "capture); publish() queues a 16-byte cudaMemcpyAsync on the stream (a capture records it), "
      "and mok_core.combine writes the words itself given error and error_mirror=device_address. "
      "On 'cpu' publish() copies at once. A read while a copy lands may mix two publishes: a "
      "nonzero first word says that some call recorded an error, and the words are then read "
      "from the device after a synchronize. RuntimeError for 'cuda' on a build without CUDA.")
      .def(py::init([](const std::string& device) {
             return std::make_unique<ErrorMirror>(parse_transport_device(device));
           }),
           py::arg("device"))
      .def_property_readonly("device_address", &ErrorMirror::device_address,
                             "The words' address for the device's kernels and copies (an int).")
      .def("publish", &ErrorMirror::publish, py::arg("error"), py::arg("stream") = 0,
           "Queue the copy of the error words at address `error` (int32 [4], 4-byte aligned) "
           "behind `stream`'s work ('cpu': copy now). ValueError naming a bad address.")
      .def(
          "read",
          [](const ErrorMirror& self) {
            std::int32_t words[transport::kErrorWords];
            self.read(words);
            py::list out;
            for (const std::int32_t w : words) out.append(w);
            return out;
          },
          "The four words as they are now (a list; no wait).")
      .def("clear", &ErrorMirror::clear,
           "Zero the words (once no publish is in flight: after a synchronize).");

  py::class_<ShmSegment>(
      m, "ShmSegment",
      "ShmSegment(name, nbytes, create): a POSIX shared memory segment mapped into this process, "
      "for the CPU transport. name: '/' then 1..254 characters without '/'. create=True makes a "
      "new zero-filled segment (FileExistsError if the name is taken); create=False opens an "
      "existing one of at least nbytes (FileNotFoundError if missing). System errors raise "
      "OSError with the errno text. The creator unlinks the name once every rank has mapped it.")
      .def(py::init<std::string, std::int64_t, bool>(), py::arg("name"), py::arg("nbytes"),
           py::arg("create"))
      .def_property_readonly("address", &ShmSegment::address,
                             "Address of the mapping in this process (an int); 0 once closed.")
      .def_property_readonly("nbytes", &ShmSegment::nbytes, "Bytes mapped.")
      .def_property_readonly("name", &ShmSegment::name, "The segment's name.")
      .def_property_readonly("created", &ShmSegment::created,
                             "Whether this object created the segment.")
      .def_property_readonly("closed", &ShmSegment::closed, "Whether close() has run.")
      .def("close", &ShmSegment::close,
           "Unmap the segment from this process (idempotent; also done on destruction). Every "
           "pointer into it is invalid afterwards.")
      .def("unlink", &ShmSegment::unlink,
           "Remove the segment's name (idempotent; a name already gone counts as removed). "
           "Existing mappings stay valid; the memory is freed when the last one goes.")
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__",
          [](ShmSegment& self, const py::args&) {
            self.close();
            return false;
          },
          "Close (not unlink) the segment.")
      .def("__repr__", [](const ShmSegment& self) {
        return "ShmSegment(name='" + self.name() + "', nbytes=" + std::to_string(self.nbytes()) +
               (self.closed() ? ", closed" : "") + ")";
      });
}

}  // namespace mok::core::bindings
