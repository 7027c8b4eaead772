"""Put on PYTHONPATH by bench/peers/openrlhf_grpo.py --torch-adam (only where no CUDA compiler is found):
DeepSpeed's GPU Adam (FusedAdam) is a JIT-compiled CUDA extension; this makes every process that imports
deepspeed.runtime.engine build torch.optim.AdamW instead (DeepSpeed's own "torch_adam": true optimizer
parameter), unless the optimizer runs on the CPU (ZeRO offload keeps DeepSpeedCPUAdam)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _TorchAdamHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "deepspeed.runtime.engine":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module):
            exec_module(module)
            cls = module.DeepSpeedEngine
            configure = cls._configure_basic_optimizer

            def configure_torch_adam(self, model_parameters):
                params = self.optimizer_params()
                if params is not None and not self.zero_use_cpu_optimizer():
                    params.setdefault("torch_adam", True)
                return configure(self, model_parameters)

            cls._configure_basic_optimizer = configure_torch_adam

        loader.exec_module = patched_exec  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _TorchAdamHook())
