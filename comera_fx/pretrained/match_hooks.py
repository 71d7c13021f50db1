"""Forward hooks that ``match_teacher`` puts on the two models: the hidden states to match, and (block-wise
distillation) the teacher's block inputs fed to the student's blocks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .calling import default_output, input_slot


class HiddenCapture:
    """Forward hooks keeping the first tensor output of the named modules (hidden-state matching)."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        modules = dict(model.named_modules())
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise ValueError(
                f"hidden_modules {unknown} are not modules of the model; names are those of "
                f"model.named_modules(), e.g. {list(modules)[1:4]}"
            )
        self.outputs: dict[str, Tensor] = {}
        self._handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def keep(module, args, output):
            self.outputs[name] = default_output(output)

        return keep

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class TeacherInputs:
    """Block-wise distillation: while ``active``, each named block of the student runs on the teacher's input to
    the same block instead of its own predecessor's output, so every block learns its own map from correct inputs
    (its error is not compounded by the blocks before it, and its gradient does not pass through them)."""

    def __init__(self, teacher: nn.Module, student: nn.Module, names: Sequence[str]):
        t_modules, s_modules = dict(teacher.named_modules()), dict(student.named_modules())
        self.active = False
        self.inputs: dict[str, Tensor] = {}
        self._handles = []
        for name in names:
            self._handles.append(t_modules[name].register_forward_pre_hook(self._keep(name), with_kwargs=True))
            self._handles.append(s_modules[name].register_forward_pre_hook(self._feed(name), with_kwargs=True))

    def _keep(self, name: str):
        def keep(module, args, kwargs):
            slot = input_slot(args, kwargs)
            if slot is None:
                raise ValueError(
                    f"blockwise distillation: module {name!r} was called without a tensor input; "
                    f"name blocks whose first argument (or hidden_states=) is the hidden state, "
                    f"or pass DistillConfig(blockwise_fraction=0)"
                )
            if name in self.inputs:  # a shared block (one module called several times) has no single input
                raise ValueError(
                    f"blockwise distillation: module {name!r} ran more than once in one forward "
                    f"(shared weights); name blocks that run once per forward, or pass "
                    f"DistillConfig(blockwise_fraction=0)"
                )
            self.inputs[name] = (args[slot] if isinstance(slot, int) else kwargs[slot]).detach()

        return keep

    def _feed(self, name: str):
        def feed(module, args, kwargs):
            if not self.active or name not in self.inputs:
                return None
            slot = input_slot(args, kwargs)
            if isinstance(slot, int):
                args = args[:slot] + (self.inputs[name],) + args[slot + 1 :]
            else:
                kwargs = {**kwargs, slot: self.inputs[name]}
            return args, kwargs

        return feed

    def new_step(self) -> None:
        """Forget the previous batch's inputs (called before the teacher's forward)."""
        self.inputs.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
