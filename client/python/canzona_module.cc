// canzona._canzona: the pybind11 binding of the C++ client (client/lib) for
// the Python package `canzona`. It stays thin: requests are built from
// plain Python values, responses come back as dicts (JSON for the nested
// status), every daemon error raises canzona.CanzonaError carrying the
// gRPC code name, and the GIL is released around every RPC (they block on
// the job's other ranks).
//
// Thread-safety: a Client may be used from several Python threads (the C++
// client is thread-safe); a SharedBuffer is plain memory.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "client/lib/cuda_export.h"
#include "google/protobuf/util/json_util.h"
#include "proto/shm/shared_memory.h"

namespace py = pybind11;

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

// A failed daemon call; translated into canzona.CanzonaError(code, message).
struct StatusError {
  absl::Status status;
};

PyObject* g_canzona_error = nullptr;

template <typename T>
T ValueOrThrow(absl::StatusOr<T> result) {
  if (!result.ok()) throw StatusError{result.status()};
  return *std::move(result);
}

void OkOrThrow(const absl::Status& status) {
  if (!status.ok()) throw StatusError{status};
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

// A float32-sized block of POSIX shared memory the daemon maps; exposes
// the Python buffer protocol (torch.frombuffer views it without a copy).
class SharedBuffer {
 public:
  explicit SharedBuffer(SharedMemory memory) : memory_(std::move(memory)) {}
  const std::string& name() const { return memory_.name(); }
  uint64_t nbytes() const { return memory_.size(); }
  void* data() const { return memory_.data(); }

 private:
  SharedMemory memory_;
};

v1::RankCoordinates Coords(const std::tuple<int, int, int>& rank) {
  v1::RankCoordinates c;
  c.set_pp_rank(std::get<0>(rank));
  c.set_dp_rank(std::get<1>(rank));
  c.set_tp_rank(std::get<2>(rank));
  return c;
}

// (shm name, offset, nbytes), or ("cuda", device pointer, nbytes[, event
// handle]) for a GPU tensor exported with CUDA IPC.
v1::BufferRef BufferRefOf(const py::tuple& ref, const std::string& where) {
  if ((ref.size() == 3 || ref.size() == 4) && py::isinstance<py::str>(ref[0]) &&
      ref[0].cast<std::string>() == "cuda") {
    const std::string event =
        ref.size() == 4 ? ref[3].cast<std::string>() : std::string();
    return ValueOrThrow(
        CudaBufferRef(reinterpret_cast<const void*>(ref[1].cast<uintptr_t>()),
                      ref[2].cast<uint64_t>(), event));
  }
  if (ref.size() != 3) {
    throw py::value_error(where +
                          " must be (shm name, offset, nbytes) or "
                          "(\"cuda\", device pointer, nbytes[, event handle])");
  }
  v1::BufferRef out;
  v1::ShmBufferRef* shm = out.mutable_shm();
  shm->set_name(ref[0].cast<std::string>());
  shm->set_offset(ref[1].cast<uint64_t>());
  shm->set_bytes(ref[2].cast<uint64_t>());
  return out;
}

py::dict PhaseDict(const v1::PhaseTimes& t) {
  py::dict d;
  d["reduce_scatter"] = t.reduce_scatter();
  d["local_compute"] = t.local_compute();
  d["tp_gather"] = t.tp_gather();
  d["tp_compute"] = t.tp_compute();
  d["tp_scatter"] = t.tp_scatter();
  d["all_gather"] = t.all_gather();
  d["wait"] = t.wait();
  d["total"] = t.total();
  d["dp_comm"] = t.dp_comm();
  d["dp_comm_exposed"] = t.dp_comm_exposed();
  return d;
}

// The Python face of canzona::Client.
class PyClient {
 public:
  PyClient(const std::string& target, const std::string& job_token,
           double connect_timeout, double register_timeout, double step_timeout,
           double checkpoint_timeout, const std::string& tls_ca) {
    Client::Options options;
    options.job_token = job_token;
    options.tls_ca = tls_ca;
    options.connect_timeout = absl::Seconds(connect_timeout);
    options.register_timeout = absl::Seconds(register_timeout);
    options.step_timeout = absl::Seconds(step_timeout);
    options.checkpoint_timeout = absl::Seconds(checkpoint_timeout);
    absl::StatusOr<std::unique_ptr<Client>> client;
    {
      py::gil_scoped_release release;
      client = Client::Connect(target, options);
    }
    client_ = ValueOrThrow(std::move(client));
  }

  std::string target() const { return client_->target(); }

  SharedBuffer Allocate(const std::string& job_id, int64_t global_rank,
                        uint64_t nbytes) {
    if (nbytes == 0) throw py::value_error("nbytes must be > 0");
    return SharedBuffer(ValueOrThrow(SharedMemory::Create(
        ShmName(job_id, global_rank, next_seq_++), nbytes)));
  }

  py::dict Register(const std::string& job_id,
                    const std::tuple<int, int, int>& layout,
                    const std::tuple<int, int, int>& rank,
                    const std::vector<py::tuple>& groups,
                    const std::vector<py::dict>& parameters,
                    const std::string& strategy, double alpha,
                    int64_t bucket_size, int shard_group_size) {
    v1::RegisterRequest request;
    request.set_job_id(job_id);
    request.mutable_layout()->set_pp(std::get<0>(layout));
    request.mutable_layout()->set_dp(std::get<1>(layout));
    request.mutable_layout()->set_tp(std::get<2>(layout));
    *request.mutable_rank() = Coords(rank);
    request.set_strategy(strategy);
    request.set_alpha(alpha);
    request.set_bucket_size(bucket_size);
    request.set_shard_group_size(shard_group_size);
    for (const py::tuple& g : groups) {
      if (g.size() != 3) {
        throw py::value_error("groups: (name, optimizer, settings) expected");
      }
      v1::OptimizerGroup* group = request.add_groups();
      group->set_name(g[0].cast<std::string>());
      group->set_optimizer(g[1].cast<std::string>());
      for (auto [key, value] : g[2].cast<py::dict>()) {
        v1::Setting* s = group->add_settings();
        s->set_key(py::str(key).cast<std::string>());
        s->set_value(py::str(value).cast<std::string>());
      }
    }
    for (const py::dict& p : parameters) {
      v1::Parameter* q = request.add_parameters();
      const std::string name = p["name"].cast<std::string>();
      q->set_name(name);
      for (int64_t d : p["shape"].cast<std::vector<int64_t>>()) q->add_shape(d);
      q->set_dtype(v1::DTYPE_FLOAT32);
      q->set_tp_split_dim(p["tp_split_dim"].cast<int>());
      q->set_group(p["group"].cast<std::string>());
      *q->mutable_param() = BufferRefOf(p["param"].cast<py::tuple>(),
                                        "parameter " + name + " param");
      *q->mutable_grad() = BufferRefOf(p["grad"].cast<py::tuple>(),
                                       "parameter " + name + " grad");
    }
    absl::StatusOr<v1::RegisterResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->Register(std::move(request));
    }
    const v1::RegisterResponse r = ValueOrThrow(std::move(response));
    py::dict out;
    out["plan_digest"] = r.plan_digest();
    out["owned_parameters"] = r.owned_parameters();
    out["state_bytes"] = r.state_bytes();
    // Per bucket, the indices of its parameters (in `parameters`).
    py::list buckets;
    for (const v1::Bucket& b : r.buckets()) {
      buckets.append(py::cast(
          std::vector<int>(b.parameters().begin(), b.parameters().end())));
    }
    out["buckets"] = buckets;
    return out;
  }

  void GradReady(const std::string& job_id,
                 const std::tuple<int, int, int>& rank, int64_t step,
                 const std::vector<int>& buckets) {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->GradReady(job_id, Coords(rank), step, buckets);
    }
    OkOrThrow(status);
  }

  double WaitParams(const std::string& job_id,
                    const std::tuple<int, int, int>& rank, int64_t step,
                    int bucket) {
    absl::StatusOr<v1::WaitParamsResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->WaitParams(job_id, Coords(rank), step, bucket);
    }
    return ValueOrThrow(std::move(response)).waited_seconds();
  }

  py::dict Step(const std::string& job_id,
                const std::tuple<int, int, int>& rank, int64_t step,
                const std::map<std::string, double>& lr, double grad_scale,
                bool async_params) {
    v1::StepRequest request;
    request.set_async_params(async_params);
    request.set_job_id(job_id);
    *request.mutable_rank() = Coords(rank);
    request.set_step(step);
    for (const auto& [group, value] : lr)
      (*request.mutable_lr())[group] = value;
    request.set_grad_scale(grad_scale);
    absl::StatusOr<v1::StepResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->Step(request);
    }
    const v1::StepResponse r = ValueOrThrow(std::move(response));
    py::dict out;
    out["seconds"] = PhaseDict(r.seconds());
    out["grad_norm"] = r.grad_norm();
    out["update_rms"] = r.update_rms();
    out["skipped_nonfinite"] = r.skipped_nonfinite();
    return out;
  }

  py::tuple GetPlan(const std::string& job_id) {
    absl::StatusOr<v1::GetPlanResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->GetPlan(job_id);
    }
    const v1::GetPlanResponse r = ValueOrThrow(std::move(response));
    return py::make_tuple(r.plan_json(), r.digest());
  }

  void Deregister(const std::string& job_id,
                  const std::tuple<int, int, int>& rank) {
    absl::Status status;
    {
      py::gil_scoped_release release;
      status = client_->Deregister(job_id, Coords(rank));
    }
    OkOrThrow(status);
  }

  std::string Status() {
    absl::StatusOr<v1::GetStatusResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->GetStatus();
    }
    return ToJson(ValueOrThrow(std::move(response)));
  }

  py::dict SaveCheckpoint(const std::string& job_id,
                          const std::tuple<int, int, int>& rank,
                          const std::string& dir, int64_t at_step) {
    absl::StatusOr<v1::SaveCheckpointResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->SaveCheckpoint(job_id, Coords(rank), dir, at_step);
    }
    const v1::SaveCheckpointResponse r = ValueOrThrow(std::move(response));
    py::dict out;
    out["step"] = r.step();
    out["records"] = r.records();
    out["bytes"] = r.bytes();
    out["seconds"] = r.seconds();
    return out;
  }

  py::dict LoadCheckpoint(const std::string& job_id,
                          const std::tuple<int, int, int>& rank,
                          const std::string& dir) {
    absl::StatusOr<v1::LoadCheckpointResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->LoadCheckpoint(job_id, Coords(rank), dir);
    }
    const v1::LoadCheckpointResponse r = ValueOrThrow(std::move(response));
    py::dict out;
    out["step"] = r.step();
    out["records"] = r.records();
    out["seconds"] = r.seconds();
    return out;
  }

  py::dict ExportState(const std::string& job_id,
                       const std::tuple<int, int, int>& rank) {
    absl::StatusOr<v1::ExportStateResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->ExportState(job_id, Coords(rank));
    }
    const v1::ExportStateResponse r = ValueOrThrow(std::move(response));
    py::dict out;
    out["state"] = py::bytes(r.state());
    out["step"] = r.step();
    out["plan_digest"] = r.plan_digest();
    out["records"] = r.records();
    return out;
  }

  py::dict ImportState(const std::string& job_id,
                       const std::tuple<int, int, int>& rank,
                       const py::bytes& state, int64_t step,
                       const std::string& plan_digest) {
    v1::ImportStateRequest request;
    request.set_job_id(job_id);
    *request.mutable_rank() = Coords(rank);
    request.set_state(std::string(state));
    request.set_step(step);
    request.set_plan_digest(plan_digest);
    absl::StatusOr<v1::ImportStateResponse> response;
    {
      py::gil_scoped_release release;
      response = client_->ImportState(request);
    }
    const v1::ImportStateResponse r = ValueOrThrow(std::move(response));
    py::dict out;
    out["step"] = r.step();
    out["records"] = r.records();
    return out;
  }

 private:
  std::unique_ptr<Client> client_;
  int64_t next_seq_ = 0;
};

}  // namespace
}  // namespace canzona

PYBIND11_MODULE(_canzona, m) {
  using canzona::CudaExportEvent;
  using canzona::OkOrThrow;
  using canzona::PyClient;
  using canzona::SharedBuffer;
  using canzona::ValueOrThrow;
  m.doc() = "Binding of the Canzona C++ client (use the canzona package)";

  static py::exception<canzona::StatusError> error(m, "CanzonaError",
                                                   PyExc_RuntimeError);
  canzona::g_canzona_error = error.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const canzona::StatusError& e) {
      const std::string code(absl::StatusCodeToString(e.status.code()));
      py::object instance = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(canzona::g_canzona_error, "s",
                                std::string(e.status.message()).c_str()));
      if (!instance) return;  // the call set a Python error already
      instance.attr("code") = code;
      PyErr_SetObject(canzona::g_canzona_error, instance.ptr());
    }
  });

  py::class_<SharedBuffer>(m, "SharedBuffer", py::buffer_protocol())
      .def_property_readonly("name", &SharedBuffer::name)
      .def_property_readonly("nbytes", &SharedBuffer::nbytes)
      .def_buffer([](SharedBuffer& b) {
        return py::buffer_info(b.data(), 1, "B", 1,
                               {static_cast<py::ssize_t>(b.nbytes())}, {1},
                               /*readonly=*/false);
      });

  // The interprocess event a GPU trainer records after backward wrote its
  // gradients (the daemon's streams wait for it).
  py::class_<CudaExportEvent>(m, "CudaEvent")
      .def(py::init([](int device) {
             return ValueOrThrow(CudaExportEvent::Create(device));
           }),
           py::arg("device"))
      .def_property_readonly(
          "handle",
          [](const CudaExportEvent& e) { return py::bytes(e.handle()); })
      .def(
          "record",
          [](CudaExportEvent& e, uintptr_t stream) {
            OkOrThrow(e.Record(reinterpret_cast<void*>(stream)));
          },
          py::arg("stream") = 0);

  py::class_<PyClient>(m, "Client")
      .def(py::init<const std::string&, const std::string&, double, double,
                    double, double, const std::string&>(),
           py::arg("target"), py::arg("job_token") = "",
           py::arg("connect_timeout") = 10.0,
           py::arg("register_timeout") = 600.0, py::arg("step_timeout") = 600.0,
           py::arg("checkpoint_timeout") = 1800.0, py::arg("tls_ca") = "")
      .def_property_readonly("target", &PyClient::target)
      .def("allocate", &PyClient::Allocate, py::arg("job_id"),
           py::arg("global_rank"), py::arg("nbytes"))
      .def("register", &PyClient::Register, py::arg("job_id"),
           py::arg("layout"), py::arg("rank"), py::arg("groups"),
           py::arg("parameters"), py::arg("strategy") = "cost",
           py::arg("alpha") = 0.0, py::arg("bucket_size") = 0,
           py::arg("shard_group_size") = 0)
      .def("grad_ready", &PyClient::GradReady, py::arg("job_id"),
           py::arg("rank"), py::arg("step"), py::arg("buckets"))
      .def("wait_params", &PyClient::WaitParams, py::arg("job_id"),
           py::arg("rank"), py::arg("step"), py::arg("bucket") = -1)
      .def("step", &PyClient::Step, py::arg("job_id"), py::arg("rank"),
           py::arg("step"), py::arg("lr") = std::map<std::string, double>(),
           py::arg("grad_scale") = 0.0, py::arg("async_params") = false)
      .def("get_plan", &PyClient::GetPlan, py::arg("job_id"))
      .def("deregister", &PyClient::Deregister, py::arg("job_id"),
           py::arg("rank"))
      .def("status_json", &PyClient::Status)
      .def("save_checkpoint", &PyClient::SaveCheckpoint, py::arg("job_id"),
           py::arg("rank"), py::arg("dir"), py::arg("at_step") = 0)
      .def("load_checkpoint", &PyClient::LoadCheckpoint, py::arg("job_id"),
           py::arg("rank"), py::arg("dir"))
      .def("export_state", &PyClient::ExportState, py::arg("job_id"),
           py::arg("rank"))
      .def("import_state", &PyClient::ImportState, py::arg("job_id"),
           py::arg("rank"), py::arg("state"), py::arg("step"),
           py::arg("plan_digest"));
}
