// A recorded sequence of dispatcher calls, replayed from C++ with the GIL released.
//
// A decode step at batch 1 is ~500 small op calls (16 per layer of a 30-layer model); from
// Python each pays interpreter and argument-parsing time before its kernel starts, about as
// much as the kernels themselves on a small model (docs/BENCHMARKS.md, 'Measurements behind
// design choices'). The tape (built by tokenloom/layers/op_tape.py from one eager run under a
// dispatch mode) holds each call's operator handle and its arguments as IValues; a replay
// pushes them on a stack and calls the boxed kernel (a fraction of that overhead), so the same
// kernels run on the same arguments in the same order: the same bits as the eager forward.
//
// Values: slot i holds a tensor the step produces or takes as input (the inputs: slots 0..n-1). Argument j of call c is
// either a constant IValue (weights, the KV cache, shapes, scalars), slot `arg_slots[c][j]`, or
// (arg_slots -2) a tensor list whose elements are slots or constant tensors (torch.cat's).
// A slot is released after its last reader so that activations are freed as eagerly as in
// the Python forward.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

constexpr int64_t CONSTANT = -1, TENSOR_LIST = -2;

struct ListArg {                        // a Tensor[] argument: element e is slots[e] or constants[e]
  std::vector<int64_t> slots;           // -1: the constant
  std::vector<at::Tensor> constants;
};

struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> constants;   // one per schema argument (None where a slot goes)
  std::vector<int64_t> arg_slots;       // one per schema argument, CONSTANT, or TENSOR_LIST
  std::vector<ListArg> lists;           // the TENSOR_LIST arguments, in argument order
  std::vector<std::vector<int64_t>> out_slots;   // per return: {its slot}, or its elements' (Tensor[]); -1: dropped
  std::vector<bool> returns_list;       // per return: a Tensor[] (split's)
  std::vector<int64_t> release;         // slots read for the last time by this call
};

// A Python value as the IValue the schema argument takes. A number where a Tensor goes (x * 2
// reaches the dispatcher as mul.Tensor(x, 2)) becomes the "wrapped number" tensor that
// torch's own argument parser makes, so type promotion treats it as a scalar again.
c10::IValue constant(const py::handle& value, const c10::Argument& argument) {
  const bool tensor_slot = argument.type()->kind() == c10::TypeKind::TensorType;
  if (tensor_slot && (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value)) &&
      !py::isinstance<py::bool_>(value)) {
    at::Tensor wrapped = py::isinstance<py::int_>(value) ? at::scalar_tensor(value.cast<int64_t>(), at::kLong)
                                                         : at::scalar_tensor(value.cast<double>(), at::kDouble);
    wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
    return wrapped;
  }
  return torch::jit::toIValue(value, argument.type());
}

class OpTape {
 public:
  // calls: [(qualified name "lib::op", overload, args, arg_slots, out_slots, release, list_slots)]:
  // args one Python value per schema argument (ignored where arg_slots is >= 0; for a
  // TENSOR_LIST, the list with None where list_slots[j] names a slot).
  OpTape(const py::list& calls, int64_t num_inputs, int64_t output_slot, int64_t num_slots)
      : num_inputs_(num_inputs), output_slot_(output_slot), num_slots_(num_slots) {
    for (const auto& item : calls) {
      const auto spec = item.cast<py::tuple>();
      const auto name = spec[0].cast<std::string>(), overload = spec[1].cast<std::string>();
      auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
      const auto& schema = op.schema();
      const auto args = spec[2].cast<py::list>();
      auto arg_slots = spec[3].cast<std::vector<int64_t>>();
      TORCH_CHECK(args.size() == schema.arguments().size() && arg_slots.size() == args.size(),
                  name, ": ", args.size(), " arguments recorded, the schema has ", schema.arguments().size());
      const auto list_slots = spec[6].cast<py::dict>();
      std::vector<c10::IValue> constants;
      std::vector<ListArg> lists;
      constants.reserve(args.size());
      for (size_t j = 0; j < args.size(); ++j) {
        if (arg_slots[j] == TENSOR_LIST) {
          ListArg list{list_slots[py::int_(j)].cast<std::vector<int64_t>>(), {}};
          for (const auto& element : args[j].cast<py::list>())
            list.constants.push_back(element.is_none() ? at::Tensor() : element.cast<at::Tensor>());
          lists.push_back(std::move(list));
        }
        constants.push_back(arg_slots[j] != CONSTANT ? c10::IValue() : constant(args[j], schema.arguments()[j]));
      }
      std::vector<std::vector<int64_t>> out_slots;
      std::vector<bool> returns_list;
      for (const auto& slot : spec[4].cast<py::list>()) {
        returns_list.push_back(py::isinstance<py::list>(slot));
        out_slots.push_back(returns_list.back() ? slot.cast<std::vector<int64_t>>()
                                                : std::vector<int64_t>{slot.cast<int64_t>()});
      }
      TORCH_CHECK(out_slots.size() == schema.returns().size(), name, ": returns do not match the schema");
      calls_.push_back(Call{op, std::move(constants), std::move(arg_slots), std::move(lists), std::move(out_slots),
                            std::move(returns_list), spec[5].cast<std::vector<int64_t>>()});
    }
  }

  // inputs (slots 0..n-1) -> the output slot's tensor after every call ran.
  at::Tensor run(const std::vector<at::Tensor>& inputs) const {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == num_inputs_, "the tape takes ", num_inputs_, " inputs, got ",
                inputs.size());
    py::gil_scoped_release no_gil;
    std::vector<at::Tensor> slots(num_slots_);
    std::copy(inputs.begin(), inputs.end(), slots.begin());
    torch::jit::Stack stack;
    for (const Call& call : calls_) {
      stack.clear();
      auto list = call.lists.begin();
      for (size_t j = 0; j < call.constants.size(); ++j) {
        const int64_t slot = call.arg_slots[j];
        if (slot == TENSOR_LIST) {
          c10::List<at::Tensor> tensors;
          for (size_t e = 0; e < list->slots.size(); ++e)
            tensors.push_back(list->slots[e] >= 0 ? slots[list->slots[e]] : list->constants[e]);
          stack.emplace_back(std::move(tensors));
          ++list;
        } else {
          stack.emplace_back(slot >= 0 ? c10::IValue(slots[slot]) : call.constants[j]);
        }
      }
      call.op.callBoxed(stack);
      for (size_t r = 0; r < call.out_slots.size(); ++r) {
        const auto& to = call.out_slots[r];
        if (!call.returns_list[r]) {
          if (to[0] >= 0) slots[to[0]] = stack[r].toTensor();
          continue;
        }
        const auto tensors = stack[r].toTensorList();
        TORCH_CHECK(tensors.size() == to.size(), "a replayed call returned ", tensors.size(), " tensors, ",
                    to.size(), " when recorded");
        for (size_t e = 0; e < to.size(); ++e)
          if (to[e] >= 0) slots[to[e]] = tensors[e];
      }
      for (int64_t s : call.release) slots[s] = at::Tensor();
    }
    return slots[output_slot_];
  }

  int64_t size() const { return static_cast<int64_t>(calls_.size()); }

 private:
  std::vector<Call> calls_;
  int64_t num_inputs_, output_slot_, num_slots_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<OpTape>(m, "OpTape")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t>())
      .def("run", &OpTape::run)
      .def("__len__", &OpTape::size);
}
