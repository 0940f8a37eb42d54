"""``PrivacyEngine``: the one place that puts compile, DP optimizer, Poisson sampling and accounting
together, with the surface Opacus users know::

    engine = PrivacyEngine()                          # accountant="pld", secure_mode=False
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()                              # clip, noise, update; the accountant records the step
    engine.get_epsilon(delta=1e-5)

``make_private`` compiles the model (:func:`fxdp.compile_for_dp`, whose report ``fxdp.report(model)``
shows; a model DP-SGD cannot train is refused with the findings), wraps the optimizer in
:class:`fxdp.optim.DPOptimizer` reading the compiled model's gradient sink, replaces the loader by a
Poisson-sampling one, and has every optimizer step recorded by the accountant.

Checkpoints (:meth:`PrivacyEngine.save_checkpoint` / :meth:`PrivacyEngine.load_checkpoint`) keep the
model's weights, the optimizer's state (with the noise generator's state, when one is used) and the
accountant's history, so a resumed run never forgets the privacy it already spent.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.weak import WeakIdKeyDictionary

from fxdp.accounting import create_accountant, get_noise_multiplier, steps_in_epochs
from fxdp.compile_option import check_compile_is_possible, compile_options
from fxdp.correlated_noise import (check_correlated_noise, correlated_accountant, correlated_noise_multiplier,
                                   cyclic_loader)
from fxdp.diagnostics import AlreadyPrivateError, location_of_caller
from fxdp.data import DPDataLoader
from fxdp.graphs.loader import DPGraphDataLoader, is_graph_loader
from fxdp.data.loader import loader_options
from fxdp.data.padding import check_padding_supported, padded_batches_for
from fxdp.distributed import (DPDistributedDataParallel, check_poisson_group, global_batch_size, split_data_parallel,
                              wrap_like)
from fxdp.distributed.fsdp import DPFullyShardedModule, sharding_plan_of
from fxdp.engines import DPLossFastGradientClipping
from fxdp.optim import DPOptimizer
from fxdp.optim.correlated import noise_mechanism_from
from fxdp.optim.noise import secure_seed
from fxdp.preparation import prepare_model, prepare_optimizer
from fxdp.user_level import check_user_level, unit_of_the_accountant, unit_of_the_checkpoint, user_level_loader
from fxdp.runtime.loss_probe import batch_probe_of  # the first batch's labels followed into the loss
from fxdp.validators import ModuleValidator

# checkpoint keys
MODULE_KEY = "module_state_dict"
OPTIMIZER_KEY = "optimizer_state_dict"
ACCOUNTANT_KEY = "privacy_accountant_state_dict"
PRIVACY_UNIT_KEY = "privacy_unit"  # "example" or "user": what the accountant's ε is for
SCHEDULER_KEYS = {"noise_scheduler": "noise_scheduler_state_dict",
                  "grad_clip_scheduler": "grad_clip_scheduler_state_dict"}

# How ε is accounted for a loader kept as it is (make_private(poisson_sampling=False)):
# "poisson" reports the Poisson figure at rate 1 / len(loader), as Opacus does: an approximation that is
# not a proven bound for shuffled fixed-size batches; "per_epoch" is a sound bound without amplification:
# each sample is in at most one batch of an epoch, so an epoch spends one Gaussian mechanism on it.
FIXED_BATCH_ACCOUNTING = ("poisson", "per_epoch")

# parameter -> (the PrivacyEngine that made it private, where make_private was called): one PrivacyEngine per model
_PRIVATE_BY: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


class PrivacyEngine:
    """Makes a model, its optimizer and its data loader private, and accounts for the privacy spent.

    Args:
        accountant: the accountant's name for :func:`fxdp.accounting.create_accountant`: ``"pld"`` (the
            default, privacy-loss distributions: the tightest bound, at most Opacus's default PRV figure),
            ``"rdp"`` (Rényi DP, a looser bound, pure math), ``"prv"`` (Opacus's name, served by the PLD
            accountant) or ``"gdp"`` (a central-limit approximation, not a bound).
        secure_mode: noise from the OS's cryptographic source, guarded against the floating-point
            attack (:mod:`fxdp.optim.noise`). The Poisson sampler takes a ``torch.Generator`` (Mersenne
            Twister, not a cryptographic generator); in secure mode it is seeded with 63 bits from the
            OS, so its draws cannot be replayed from a known seed.
    """

    def __init__(self, accountant: str = "pld", secure_mode: bool = False):
        self.accountant_name = accountant
        self.accountant = create_accountant(accountant)
        self.secure_mode = secure_mode
        # compiled model -> the model it was compiled from, so checkpoints hold the plain model's names
        self._originals: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
        self.privacy_unit = "example"  # what one ε is for: a record, or a user with all their records (make_private)
        self._poisson_figure_for_fixed_batches = False  # a make_private(poisson_sampling=False) accounts so
        self._warned_poisson_figure = False

    # -- making things private -----------------------------------------------------------------------

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        grad_sample_mode: str = "fx",
        clipping: str = "flat",
        poisson_sampling: bool = True,
        loss_reduction: str = "mean",
        batch_first: bool = True,
        example_inputs: Any = None,
        batch_inputs: Optional[Sequence[Union[str, int]]] = None,
        noise_generator: Optional[torch.Generator] = None,
        materialise_grad_sample: bool = False,
        fixed_batch_accounting: str = "poisson",
        criterion: Optional[nn.Module] = None,
        wrap_model: bool = True,
        padded_batches: Optional[Union[bool, int]] = None,
        compile: Union[bool, Dict[str, Any]] = False,  # noqa: A002 (the one-word name the issue asks for)
        privacy_unit: str = "example",
        user_ids: Any = None,
        max_records_per_user: Optional[int] = None,
        **optimizer_kwargs: Any,
    ) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
        """Returns ``(compiled model, DPOptimizer, data loader)``, or with ``criterion`` (Opacus's ghost
        clipping surface) ``(compiled model, DPOptimizer, DPLossFastGradientClipping, data loader)``: the
        criterion wrapped to return per-sample losses whose ``backward()`` is one ordinary backward.
        ``grad_sample_mode="ghost"`` is the default ``"fx"``, which book-keeps already (one backward gives
        per-sample norms and clipped sums); ``"ghost_fsdp"`` is Opacus's name for it on a model sharded with
        ``fully_shard`` (FSDP2; see docs/distributed.md), refused for any other model.
        ``wrap_model=False`` (Opacus 1.6): keep calling ``module`` itself; the hooks engine is put on it (with
        book-keeping unless ``materialise_grad_sample``) and returned in the model's place, as
        :class:`~fxdp.engines.hooks.GradSampleHooks` (``cleanup()`` detaches it; the optimizer keeps it alive).

        ``clipping="adaptive"`` builds an :class:`fxdp.optim.AdaClipDPOptimizer` (its arguments, e.g.
        ``target_unclipped_quantile``, go in ``optimizer_kwargs``; the accountant records ``noise_multiplier``,
        which that optimizer's two noises together amount to).

        ``max_grad_norm`` is the clipping bound C (for ``clipping="per_layer"``, a list with one bound
        per trainable parameter of the optimizer). With ``poisson_sampling`` (what the accounting
        assumes) the loader draws each sample into each batch independently with rate
        ``1 / len(data_loader)``, and the gradient of a ``"mean"`` loss is divided by the *expected*
        batch size; without it the loader is kept, and ``fixed_batch_accounting`` says how its steps are
        accounted: ``"poisson"`` (default, as Opacus) reports the Poisson ε at rate ``1 / len(loader)``,
        which is not a proven bound for shuffled fixed-size batches (:meth:`get_epsilon` warns once);
        ``"per_epoch"`` is a sound bound for a loader that puts every sample in at most one batch per
        epoch (shuffled or sequential, no replacement): each epoch begun is recorded as one Gaussian
        mechanism on the whole dataset (sample rate 1), i.e. no amplification by sampling.
        ``example_inputs``: a batch to compile with (without it, the analysis runs on the first
        batch; a model torch.fx cannot trace, as Hugging Face models, is captured with torch.export from a
        batch of the dataset's first two samples made by the loader's collate function, without drawing
        from the loader or any random generator: see :func:`fxdp.data.example_inputs.inputs_from_the_loader`).
        ``batch_inputs``: the names (or positions) of the model's inputs that hold one row per sample, as for
        :func:`fxdp.compile_for_dp` (the others are shared by all samples); fxdp asks for it where the inputs can
        be read two ways. Inputs captured from the loader's batch are batched: every tensor its collate makes
        holds one row per sample.
        ``noise_generator``: a ``torch.Generator`` for reproducible noise (not in secure mode).

        With ``grad_sample_mode="fx"`` the step is book-kept (:class:`~fxdp.sinks.bookkeeping.BookkeepingSink`):
        one backward gives each layer's per-sample norms and clipped sum without materialising per-sample
        gradients, and ``fxdp.report(module)`` says per layer how. ``materialise_grad_sample=True`` keeps
        ``p.grad_sample`` instead (the other engines always materialise it).

        ``padded_batches``: pad every Poisson batch with rows of zeros to one of a few fixed sizes, so that a
        compiled step sees few shapes (:class:`~fxdp.data.DPDataLoader`, :mod:`fxdp.data.padding`): ``True`` (a
        base size from the expected batch size), an int (that base size), ``False`` (no padding) or ``None``, the
        default: fxdp chooses, padding where ``compile`` is asked for (:func:`~fxdp.data.padding.padded_batches_for`).
        The padding rows are dropped before clipping (no gradient, no norm, no count) and the accounting is unchanged;
        the model and the loss run on them (their cost), and a loss summed or averaged over the batch's rows gives
        the update it gives without padding (docs/training.md, "Padded batches"). Needs ``poisson_sampling``; not
        with ``criterion``, nor across processes, yet.

        ``compile=True`` returns the private model ``torch.compile``'d in place (:meth:`torch.nn.Module.compile`:
        the same object, its ``state_dict`` names, report, sink and checkpoints unchanged), one graph per forward
        (the layers deliver from the compiled backward); a dict passes torch.compile's options, e.g.
        ``compile={"backend": "aot_eager"}`` or ``{"mode": "reduce-overhead"}``. For the graph engine on one
        process only (other engines and DDP/FSDP are refused); the optimizer's step stays eager
        (:mod:`fxdp.compile_option`, docs/torch_compile.md).

        ``noise_mechanism`` (in ``optimizer_kwargs``): ``"gaussian"`` (default) or ``BandedMatrixFactorization(b)``,
        noise correlated over b steps: the loader is then cyclic Poisson and the accountant the banded MF one; BLT,
        tree aggregation and banded MF with ``steps=`` get a fixed-epoch loader and min-separation accounting
        (:mod:`fxdp.correlated_noise`, docs/correlated_noise.md).

        ``privacy_unit="user"`` (default ``"example"``): user-level DP-SGD, ε for a user with all their records
        (``user_ids``: each record's user; ``max_records_per_user``: k). Users are Poisson-sampled at rate
        ``1 / len(data_loader)``, up to k records each, each user's averaged gradient clipped to C as one unit
        (:mod:`fxdp.user_level`, docs/user_level.md).
        """
        compile_with = compile_options(compile)  # None: not compiled
        sharded = sharding_plan_of(module)  # FSDP2 (fully_shard): its plan; FSDP1 is refused with the reason
        across_processes = sharded is not None or isinstance(module, DistributedDataParallel)
        by_user = check_user_level(
            privacy_unit=privacy_unit, user_ids=user_ids, max_records_per_user=max_records_per_user,
            poisson_sampling=poisson_sampling, clipping=clipping, padded_batches=padded_batches, criterion=criterion,
            mechanism=optimizer_kwargs.get("noise_mechanism"),
            fixed_batch_accounting=fixed_batch_accounting, wrap_model=wrap_model)
        padded_batches = False if by_user else padded_batches
        unit = unit_of_the_accountant(self.privacy_unit, privacy_unit, len(self.accountant))  # set once it is private
        grad_sample_mode = _engine_mode(grad_sample_mode, sharded)
        padded_batches = padded_batches_for(padded_batches, compiled=compile_with is not None,
                                            poisson_sampling=poisson_sampling, criterion=criterion is not None)
        if padded_batches is not False:
            check_padding_supported(poisson_sampling=poisson_sampling, criterion=criterion is not None,
                                    across_processes=across_processes)
        _check_types(module, optimizer, data_loader)
        mechanism = noise_mechanism_from(optimizer_kwargs.get("noise_mechanism"))
        if mechanism is not None:  # correlated noise: its sampling and accounting (fxdp/correlated_noise.py)
            check_correlated_noise(mechanism, accountant=self.accountant, accountant_name=self.accountant_name,
                                   poisson_sampling=poisson_sampling, padded_batches=padded_batches,
                                   across_processes=across_processes)
        _check_optimizer_params_in_module(module, optimizer)
        self._check_not_private_elsewhere(module)
        steps_per_epoch = _check_fixed_batch_accounting(fixed_batch_accounting, poisson_sampling, data_loader, module)
        module, ddp = split_data_parallel(module) if sharded is None else (module, None)
        if compile_with is not None:
            check_compile_is_possible(grad_sample_mode=grad_sample_mode, wrap_model=wrap_model,
                                      data_parallel=ddp is not None, sharded=sharded is not None)

        compiled = prepare_model(module, data_loader, grad_sample_mode=grad_sample_mode, sharded=sharded, ddp=ddp,
                                 wrap_model=wrap_model, materialise_grad_sample=materialise_grad_sample,
                                 batch_first=batch_first, loss_reduction=loss_reduction,
                                 example_inputs=example_inputs, batch_inputs=batch_inputs, compile_with=compile_with)
        self._originals[compiled] = module
        if by_user:  # users Poisson-sampled; expected_batch_size: the expected number of users per batch
            data_loader = user_level_loader(
                data_loader, generator=torch.Generator().manual_seed(secure_seed()) if self.secure_mode else None,
                across=ddp if sharded is None else sharded, user_ids=user_ids,
                max_records_per_user=max_records_per_user, batch_first=batch_first)
            sample_rate, expected_batch_size = data_loader.sample_rate, data_loader.expected_users
        else:
            data_loader, sample_rate, expected_batch_size = self._prepare_data(
                data_loader, poisson_sampling, ddp if sharded is None else sharded, padded_batches=padded_batches,
                batch_first=batch_first, mechanism=mechanism)
        dp_optimizer = prepare_optimizer(
            optimizer, compiled, module, clipping=clipping, ddp=ddp, sharded=sharded, by_user=by_user,
            optimizer_kwargs=optimizer_kwargs, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size, loss_reduction=loss_reduction, secure_mode=self.secure_mode,
            generator=noise_generator)
        if not wrap_model:
            dp_optimizer.attached_hooks = compiled  # the hooks live as long as the optimizer that reads them
        data_loader = self._prepare_accountant(dp_optimizer, data_loader, fixed_batch_accounting=fixed_batch_accounting,
                                               poisson_sampling=poisson_sampling, sample_rate=sample_rate,
                                               steps_per_epoch=steps_per_epoch, mechanism=mechanism)
        self._claim(module)
        self.privacy_unit = unit

        if isinstance(data_loader, DPDataLoader):  # a step then knows how many batches it covers, and empty ones
            data_loader.batch_observer = dp_optimizer.observe_batch
            data_loader.batch_probe = batch_probe_of(compiled) if ddp is None and sharded is None else None
            dp_optimizer.expect_observed_batches()
        if ddp is not None:
            compiled = wrap_like(compiled, ddp)
        if sharded is not None:
            compiled = DPFullyShardedModule(module, compiled, sharded)
        if criterion is not None:
            return compiled, dp_optimizer, DPLossFastGradientClipping(
                compiled, dp_optimizer, criterion, loss_reduction), data_loader
        return compiled, dp_optimizer, data_loader

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: Union[float, Sequence[float]],
        epsilon_tolerance: float = 0.01,
        **kwargs: Any,
    ) -> Tuple[nn.Module, DPOptimizer, DataLoader]:
        """:meth:`make_private` with the smallest noise multiplier (within ``epsilon_tolerance``) for
        which ``epochs`` epochs of training spend at most ``target_epsilon`` at ``target_delta``: ε after
        the last step lies in ``[target_epsilon - epsilon_tolerance, target_epsilon]`` (an absolute
        tolerance, Opacus's default; see :func:`~fxdp.accounting.get_noise_multiplier`). An epoch is
        ``len(data_loader)`` steps, as many as the loader yields (a fractional number of epochs is
        rounded up to whole steps).

        The target covers the steps of this training; an accountant that already holds steps (a
        resumed run) reports their privacy on top.
        """
        batches = len(data_loader)  # make_private's Poisson loader: rate 1 / batches, that many steps an epoch
        if kwargs.get("fixed_batch_accounting") == "per_epoch":  # one mechanism, at rate 1, per epoch begun
            sample_rate, steps = 1.0, steps_in_epochs(epochs, 1.0)
        else:
            sample_rate, steps = 1.0 / batches, steps_in_epochs(epochs * batches, 1.0)
        mechanism = noise_mechanism_from(kwargs.get("noise_mechanism"))
        if mechanism is not None:  # the cyclic loader's steps, accounted as banded MF (fxdp/correlated_noise.py)
            noise_multiplier = correlated_noise_multiplier(mechanism, data_loader, target_epsilon=target_epsilon,
                                                           target_delta=target_delta, epochs=epochs,
                                                           epsilon_tolerance=epsilon_tolerance)
        else:
            noise_multiplier = get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                                    sample_rate=sample_rate, steps=steps,
                                                    accountant=self.accountant_name,
                                                    epsilon_tolerance=epsilon_tolerance)
        return self.make_private(module=module, optimizer=optimizer, data_loader=data_loader,
                                 noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, **kwargs)

    # -- checking a model first (Opacus's names) ---------------------------------------------------------

    @staticmethod
    def get_compatible_module(module: nn.Module) -> nn.Module:
        """A fixed copy of ``module`` (:meth:`fxdp.validators.ModuleValidator.fix`: batch norm replaced, in-place
        flags off), validated: raises :class:`~fxdp.validators.UnsupportedModuleError` if problems remain."""
        fixed = ModuleValidator.fix(module)
        ModuleValidator.validate(fixed, strict=True)
        return fixed

    def is_compatible(self, *, module: nn.Module, optimizer: Optional[Optimizer] = None,
                      data_loader: Optional[DataLoader] = None) -> bool:
        """Whether the registered validators find nothing in ``module`` (:meth:`validate` without raising).
        ``optimizer`` and ``data_loader`` are accepted for Opacus code and not examined. make_private goes
        further: it compiles the model and refuses, with the user's line, what the validators cannot see (an op
        that moves the batch or mixes samples)."""
        return ModuleValidator.is_valid(module)

    def validate(self, *, module: nn.Module, optimizer: Optional[Optimizer] = None,
                 data_loader: Optional[DataLoader] = None) -> None:
        """Raise :class:`~fxdp.validators.UnsupportedModuleError` listing what the validators find in
        ``module`` (see :meth:`is_compatible`)."""
        ModuleValidator.validate(module, strict=True)

    def get_epsilon(self, delta: float) -> float:
        """The ε spent so far at ``delta``, by the accountant (every logical step made private by this
        PrivacyEngine, and those restored from a checkpoint), for one unit of :attr:`privacy_unit`: a record
        (``"example"``, the default) or a user with all their records (``make_private(privacy_unit="user")``).

        The accountant analyses Poisson sampling. For a model made private with
        ``poisson_sampling=False`` and the default ``fixed_batch_accounting="poisson"``, the figure is
        the Poisson one at rate ``1 / len(loader)``, which is not a proven bound for shuffled fixed-size
        batches (their real ε can be larger): a warning says so, once. ``poisson_sampling=True``, or
        ``fixed_batch_accounting="per_epoch"`` (a sound bound without amplification), report an ε that
        holds."""
        if self._poisson_figure_for_fixed_batches and not self._warned_poisson_figure:
            self._warned_poisson_figure = True
            warnings.warn(
                "fxdp: this ε is the Poisson-sampling figure, but the model was made private with "
                "poisson_sampling=False (fixed-size batches): it is not a proven bound for them, and their real "
                "ε can be larger. For an ε that holds, use poisson_sampling=True, or make_private(..., "
                "poisson_sampling=False, fixed_batch_accounting='per_epoch') for a bound without amplification",
                stacklevel=2)
        return self.accountant.get_epsilon(delta)

    def _prepare_data(self, data_loader: DataLoader, poisson_sampling: bool, ddp=None, *,
                      padded_batches: Union[bool, int] = False, batch_first: bool = True,
                      mechanism: Any = None) -> Tuple[DataLoader, float, Optional[int]]:
        if poisson_sampling:
            # secure mode: the sampler is a torch generator, seeded from the OS's cryptographic source
            generator = torch.Generator().manual_seed(secure_seed()) if self.secure_mode else None
            if ddp is not None:  # one shared mask over the global dataset, each rank its share
                check_poisson_group(ddp.process_group)
            if mechanism is not None:  # banded MF: cyclic Poisson sampling, partitions = bands
                return cyclic_loader(data_loader, mechanism, generator, batch_first, distributed=ddp is not None)
            loader_class = DPGraphDataLoader if is_graph_loader(data_loader) else DPDataLoader  # PyG: fxdp/graphs
            dp_loader = loader_class.from_data_loader(data_loader, generator=generator, distributed=ddp is not None,
                                                      padded_batches=padded_batches, batch_first=batch_first)
            sample_rate = dp_loader.sample_rate
            # rounded, not truncated: 49 samples at rate 1/49 expect 1 (int(49 * (1 / 49)) is 0)
            return dp_loader, sample_rate, max(1, round(len(data_loader.dataset) * sample_rate))
        if ddp is not None:  # a DistributedSampler's share per rank: the global batch is world_size of them
            return data_loader, 1.0 / len(data_loader), global_batch_size(data_loader, ddp.process_group)
        return data_loader, 1.0 / len(data_loader), data_loader.batch_size

    def _prepare_accountant(self, dp_optimizer: DPOptimizer, data_loader: DataLoader, *, fixed_batch_accounting: str,
                            poisson_sampling: bool, sample_rate: float, steps_per_epoch: Optional[int],
                            mechanism: Any) -> DataLoader:
        """Every step of ``dp_optimizer`` recorded by the accountant, as ``fixed_batch_accounting`` and the noise
        mechanism say; returns the loader (counting its epochs for ``"per_epoch"``)."""
        if fixed_batch_accounting == "per_epoch":
            data_loader = _EpochsCounted(data_loader)
            dp_optimizer.attach_step_hook(self._per_epoch_accountant_hook(data_loader, steps_per_epoch))
        else:
            self._poisson_figure_for_fixed_batches |= not poisson_sampling
            dp_optimizer.attach_step_hook(self._accountant_hook(sample_rate))
        if mechanism is not None:
            self.accountant = correlated_accountant(mechanism, data_loader)
        return data_loader

    def _accountant_hook(self, sample_rate: float):
        def step_accountant(optimizer: DPOptimizer) -> None:
            # the optimizer's current multiplier: a checkpoint or a user may have changed it
            self.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=sample_rate)

        return step_accountant

    def _per_epoch_accountant_hook(self, loader: "_EpochsCounted", steps_per_epoch: int):
        """``fixed_batch_accounting="per_epoch"``: the first step after the loader began an epoch records one
        Gaussian mechanism at sample rate 1 (a sample's one batch of the epoch may be any of its steps); so
        does every ``steps_per_epoch``-th step without a new epoch (batches from elsewhere). A later step of
        the epoch with less noise than any recorded for it records one more: the sample's batch may be it."""
        epoch = {"steps": 0, "lowest": None}  # steps since an epoch was recorded; its lowest noise recorded

        def step_accountant(optimizer: DPOptimizer) -> None:
            sigma = optimizer.noise_multiplier
            if loader.epoch_begun or epoch["steps"] == steps_per_epoch:
                loader.epoch_begun = False
                epoch.update(steps=0, lowest=None)
            epoch["steps"] += 1
            if epoch["lowest"] is None or sigma < epoch["lowest"]:
                epoch["lowest"] = sigma
                self.accountant.step(noise_multiplier=sigma, sample_rate=1.0)

        return step_accountant

    def _check_not_private_elsewhere(self, module: nn.Module) -> None:
        """Refuse a model whose parameters another live PrivacyEngine made private: each accountant would count
        only its own steps, so neither would report the privacy spent."""
        for name, p in module.named_parameters():
            engine_ref, where = _PRIVATE_BY.get(p, (lambda: None, None))
            first = engine_ref()
            if first is not None and first is not self:
                at = f" (make_private called at {where.relative})" if where is not None else ""
                raise AlreadyPrivateError(
                    f"fxdp: parameter '{name}' of this {type(module).__name__} was already made private by another "
                    f"PrivacyEngine{at}, whose accountant has recorded {len(first.accountant)} steps. Two "
                    "PrivacyEngines would each count only their own steps, so neither would report the privacy "
                    "spent. Keep training with the first PrivacyEngine's model and optimizer, or give this one a "
                    "fresh copy of the model (copy.deepcopy of the original, before make_private)")

    def _claim(self, module: nn.Module) -> None:
        where, me = location_of_caller(), weakref.ref(self)
        for p in module.parameters():
            _PRIVATE_BY[p] = (me, where)

    # -- checkpoints ---------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        *,
        path,
        module: nn.Module,
        optimizer: Optional[DPOptimizer] = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        checkpoint_dict: Optional[Dict[str, Any]] = None,
    ) -> None:
        """Save the model's weights, the optimizer's state (and its noise generator's), the accountant's
        history and the schedulers' states (:mod:`fxdp.optim.schedulers`) to ``path`` with ``torch.save``;
        ``checkpoint_dict`` adds entries of your own (the epoch, say). The weights are saved under the plain
        model's parameter names, so ``model.load_state_dict(torch.load(path)["module_state_dict"])`` works
        without fxdp. A model sharded with ``fully_shard``: call it on every rank (the whole tensors are
        gathered), rank 0 writes; ``load_checkpoint`` on every rank, each keeps its shards."""
        checkpoint = dict(checkpoint_dict or {})
        sharded = isinstance(module, DPFullyShardedModule)  # whole tensors gathered: every rank calls, rank 0 writes
        checkpoint[MODULE_KEY] = module.full_state_dict() if sharded else self._plain(module).state_dict()
        checkpoint[ACCOUNTANT_KEY] = self.accountant.state_dict()
        checkpoint[PRIVACY_UNIT_KEY] = self.privacy_unit
        if optimizer is not None:
            checkpoint[OPTIMIZER_KEY] = optimizer.state_dict()
        for name, scheduler in (("noise_scheduler", noise_scheduler), ("grad_clip_scheduler", grad_clip_scheduler)):
            if scheduler is not None:
                checkpoint[SCHEDULER_KEYS[name]] = scheduler.state_dict()
        if not sharded or torch.distributed.get_rank() == 0:
            torch.save(checkpoint, path)

    def load_checkpoint(
        self,
        *,
        path,
        module: nn.Module,
        optimizer: Optional[DPOptimizer] = None,
        noise_scheduler: Any = None,
        grad_clip_scheduler: Any = None,
        map_location: Any = None,
    ) -> Dict[str, Any]:
        """Restore a :meth:`save_checkpoint` into ``module``, ``optimizer``, the schedulers and this PrivacyEngine's
        accountant (whose history the checkpoint's replaces). Returns the entries of ``checkpoint_dict``."""
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
        missing = [k for k in (MODULE_KEY, ACCOUNTANT_KEY) if k not in checkpoint]
        if missing:
            raise ValueError(f"fxdp: {path} is not a PrivacyEngine checkpoint (no {', '.join(missing)}); "
                             "save it with PrivacyEngine.save_checkpoint")
        if optimizer is not None and OPTIMIZER_KEY not in checkpoint:
            raise ValueError(f"fxdp: {path} holds no optimizer state (it was saved without optimizer=); "
                             "call load_checkpoint without optimizer, or save the optimizer too")
        schedulers = {"noise_scheduler": noise_scheduler, "grad_clip_scheduler": grad_clip_scheduler}
        for name, scheduler in schedulers.items():
            if scheduler is not None and SCHEDULER_KEYS[name] not in checkpoint:
                raise ValueError(f"fxdp: {path} holds no {name} state (it was saved without {name}=); call "
                                 f"load_checkpoint without {name}, or save it too")
        unit = unit_of_the_checkpoint(self.privacy_unit, checkpoint.pop(PRIVACY_UNIT_KEY, "example"), path,
                                      made_private=len(self._originals) > 0)  # (before anything is loaded)
        if isinstance(module, DPFullyShardedModule):
            module.load_full_state_dict(checkpoint.pop(MODULE_KEY))
        else:
            self._plain(module).load_state_dict(checkpoint.pop(MODULE_KEY))
        self.accountant.load_state_dict(checkpoint.pop(ACCOUNTANT_KEY))
        self.privacy_unit = unit
        optimizer_state = checkpoint.pop(OPTIMIZER_KEY, None)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
        for name, scheduler in schedulers.items():
            state = checkpoint.pop(SCHEDULER_KEYS[name], None)
            if scheduler is not None:
                scheduler.load_state_dict(state)
        return checkpoint

    def _plain(self, module: nn.Module) -> nn.Module:
        """The model a compiled one was made from (same parameters, the user's names)."""
        if module not in self._originals and isinstance(module, (DistributedDataParallel, DPDistributedDataParallel)):
            module = module.module  # the names of the model inside, as a single process saves them
        return self._originals.get(module, module)


def _engine_mode(grad_sample_mode: str, sharded: Any) -> str:
    """Opacus's names of the default mode: ``"ghost"`` (book-keeping, which the default does) and ``"ghost_fsdp"``
    (the same on a ``fully_shard`` model, refused for any other)."""
    if grad_sample_mode == "ghost_fsdp":
        if sharded is None:
            raise ValueError("fxdp: grad_sample_mode='ghost_fsdp' is for a model sharded with "
                             "torch.distributed.fsdp.fully_shard; for this model use 'ghost' or the default 'fx'")
        return "fx"
    return "fx" if grad_sample_mode == "ghost" else grad_sample_mode


def _check_types(module, optimizer, data_loader) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fxdp: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(optimizer, DPOptimizer):
        raise TypeError("fxdp: the optimizer is already a DPOptimizer; pass the original optimizer to make_private")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"fxdp: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(data_loader, DataLoader):
        raise TypeError(f"fxdp: data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")


class _EpochsCounted(DataLoader):
    """The user's loader (its dataset, batches, collate function and workers) for
    ``fixed_batch_accounting="per_epoch"``: it notes when an epoch begins, an iteration that may put every
    sample in a batch again, however many batches the one before yielded."""

    def __init__(self, data_loader: DataLoader):
        super().__init__(data_loader.dataset, batch_sampler=data_loader.batch_sampler,
                         collate_fn=data_loader.collate_fn, **loader_options(data_loader))
        self.epoch_begun = False

    def __iter__(self):
        self.epoch_begun = True
        return super().__iter__()


def _check_fixed_batch_accounting(accounting: str, poisson_sampling: bool, data_loader: DataLoader,
                                  module: nn.Module) -> Optional[int]:
    """The loader's batches per epoch for ``fixed_batch_accounting="per_epoch"`` (``None`` otherwise), after
    checking that the bound holds for it: every sample in at most one batch of an epoch."""
    if accounting not in FIXED_BATCH_ACCOUNTING:
        raise ValueError(f"fxdp: fixed_batch_accounting must be one of {FIXED_BATCH_ACCOUNTING}, got {accounting!r}")
    if accounting == "poisson":
        return None
    if poisson_sampling:
        raise ValueError("fxdp: fixed_batch_accounting='per_epoch' is for a loader kept as it is; pass "
                         "poisson_sampling=False with it (Poisson sampling is accounted as Poisson)")
    if isinstance(module, (DistributedDataParallel, DPDistributedDataParallel)):
        raise ValueError("fxdp: fixed_batch_accounting='per_epoch' is for one process: a DistributedSampler may "
                         "repeat samples to even out the ranks. Use poisson_sampling=True across processes")
    sampler = getattr(data_loader.batch_sampler, "sampler", None)
    once_each = isinstance(sampler, SequentialSampler) or (isinstance(sampler, RandomSampler)
                                                           and not sampler.replacement
                                                           and sampler.num_samples == len(sampler.data_source))
    if not once_each:
        raise ValueError(
            f"fxdp: fixed_batch_accounting='per_epoch' needs a loader that puts every sample in at most one batch "
            f"per epoch (DataLoader(dataset, batch_size=..., shuffle=True or False)); its sampler is "
            f"{type(sampler).__name__}, which may repeat samples")
    return len(data_loader)


def _check_optimizer_params_in_module(module: nn.Module, optimizer: Optimizer) -> None:
    """The optimizer must train this model: a parameter from elsewhere would get no per-sample gradient."""
    own = {id(p) for p in module.parameters()}
    foreign: List[str] = [
        f"param_groups[{g}]['params'][{i}] of shape {tuple(p.shape)}"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in own
    ]
    if foreign:
        raise ValueError(f"fxdp: the optimizer holds parameters that are not the module's ({', '.join(foreign)}) "
                         "(in Opacus's words: Module parameters are different than optimizer Parameters). Build the "
                         "optimizer from module.parameters(), after ModuleValidator.fix(module) if you call it: the "
                         "modules it replaces bring new parameters")
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    idle = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
    if idle:
        warnings.warn(f"fxdp: trainable parameters not in the optimizer ({', '.join(idle)}) get per-sample gradients "
                      "that nothing uses or clears; freeze them with requires_grad_(False)", stacklevel=3)


class PrivacyEngineAdaptiveClipping(PrivacyEngine):
    """A :class:`PrivacyEngine` whose ``make_private`` clips adaptively (Opacus's name):
    :class:`fxdp.optim.AdaClipDPOptimizer`, the bound following ``target_unclipped_quantile`` of the per-sample
    norms between ``min_clipbound`` and ``max_clipbound``; ``max_grad_norm`` is the initial bound.

    ``unclipped_num_std`` defaults to Andrew et al.'s heuristic, a twentieth of the batch size: of the EXPECTED
    batch size (Opacus takes the actual one, which makes the noise depend on the data). The accountant records
    ``noise_multiplier``: the gradient's noise and the count's together are one Gaussian mechanism of that
    multiplier (see :mod:`fxdp.optim.adaclip`), which needs ``noise_multiplier < 2 * unclipped_num_std``."""

    def make_private(self, *, module: nn.Module, optimizer: Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float, target_unclipped_quantile: float = 0.5,
                     min_clipbound: float = 1.0, max_clipbound: float = 1e8, clipbound_learning_rate: float = 0.2,
                     unclipped_num_std: Optional[float] = None, **kwargs: Any):
        if unclipped_num_std is None:
            unclipped_num_std = len(data_loader.dataset) / max(1, len(data_loader)) / 20
        return super().make_private(
            module=module, optimizer=optimizer, data_loader=data_loader, noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm, clipping="adaptive", target_unclipped_quantile=target_unclipped_quantile,
            min_clipbound=min_clipbound, max_clipbound=max_clipbound, clipbound_learning_rate=clipbound_learning_rate,
            unclipped_num_std=unclipped_num_std, **kwargs)
