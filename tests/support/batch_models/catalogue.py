"""The catalogue: each model with its inputs, its category and the lines the analysis must report.

Expected lines are found from the markers with ``inspect`` (:func:`marker_line`), never written down.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from fxdp.diagnostics import Kind
from fxdp.layout import BatchLayout

from .benign import (
    MLP, SelfAttention, PermuteAndBack, TransposeBackToBack, ConvFlatten, ConvViewN,
    BroadcastParameters, MaskInput, PositionIds, TimeMajorLSTM, ConvNet, KeywordInputs,
    TwoInputs, MHABatchFirst, LSTMBatchFirst, EmbeddingMean, BatchNormEval, PickPerSample,
    FeatureOps, EncoderLayer, TimeMajorMHA, EinsumPerSample, ClassToken, GatherPerSample,
    SDPAPerSample, WritePerSampleColumns,
)
from .moving import (
    Transpose01, Permute, Movedim, Swapaxes, TransposeT, TransposeMT,
    ReshapeMerge, TimeMajorMergeSplit, Unsqueeze0, Flatten01, PermutedImage, StackTwoViews,
    CatTwoViews, FeaturesIntoRows, TimeMajorRNN,
)
from .mixing import (
    CenterWithBatchMean, FullSum, MaxOverBatch, MinOverBatch, StdOverBatch, VarOverBatch,
    NormOverBatch, LogSumExpOverBatch, ProdOverBatch, AmaxOverBatch, BatchNormTraining, FunctionalBatchNorm,
    SoftmaxOverBatch, LogSoftmaxOverBatch, CumsumOverBatch, CumprodOverBatch, SortOverBatch, ArgsortOverBatch,
    TopkOverBatch, RollOverBatch, FlipOverBatch, AdjacencyMatmul, GramEinsum, BmmOverBatch,
    PairwiseDifferences, CatSharedRow, FirstSampleBroadcast, ShuffleByIndex, IndexSelectBatch, GatherBatch,
    NormalizeOverBatch, LayerNormOverBatch, ConvBatchInChannels, LinearOnBatch, LSTMWrongBatchFirst, MHAWrongBatchFirst,
    LossInsideModel, ConsecutiveDifference, ChunkBatch, CdistPairs, AttentionOverBatch, WriteAcrossSamples,
)
from .sizes import C, D, HW, N, T


@dataclass(frozen=True)
class Expect:
    marker: str  # the comment on the line, without '#': "MIX", "MOVE", "MOVE merge"
    kind: Kind
    layout: Optional[BatchLayout] = None  # for moves: what the node on that line must record


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[], Any]  # a tensor, a tuple of positional inputs, or a dict by name
    category: str  # "benign" | "moves" | "mixes"
    expect: Tuple[Expect, ...] = ()
    batch_dim: int = 0

    def build(self):
        torch.manual_seed(0)
        model = self.factory()
        return model, self.inputs()

    @property
    def marker(self) -> Optional[str]:
        return self.expect[0].marker if self.expect else None


def marker_line(model_or_class, marker: str) -> Tuple[str, int]:
    """(file, line) of the line in the model class whose comment is exactly ``# <marker>``."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    lines, start = inspect.getsourcelines(cls)
    hits = [start + i for i, text in enumerate(lines)
            if "#" in text and text.split("#", 1)[1].strip() == marker]
    if len(hits) != 1:
        raise LookupError(f"{cls.__name__} has {len(hits)} lines marked '# {marker}', expected exactly one")
    return inspect.getsourcefile(cls), hits[0]


def _x(*shape, long=False, high=10):
    def make():
        g = torch.Generator().manual_seed(1)
        if long:
            return torch.randint(0, high, shape, generator=g)
        return torch.randn(*shape, generator=g)
    return make


# --------------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------------


def _eval(factory):
    return lambda: factory().eval()


MIX = (Expect("MIX", Kind.MIXES_SAMPLES),)


def _move(layout: BatchLayout, marker: str = "MOVE") -> Expect:
    return Expect(marker, Kind.MOVES_BATCH, layout)


CATALOGUE: List[CatalogueModel] = [
    # benign
    CatalogueModel("mlp", MLP, _x(N, D), "benign"),
    CatalogueModel("attention_transpose_1_2", SelfAttention, _x(N, T, D), "benign"),
    CatalogueModel("permute_and_back", PermuteAndBack, _x(N, T, D), "benign"),
    CatalogueModel("transpose_back_to_back", TransposeBackToBack, _x(N, T, D), "benign"),
    CatalogueModel("flatten_from_dim_1", ConvFlatten, _x(N, C, HW, HW), "benign"),
    CatalogueModel("view_n_minus_1", ConvViewN, _x(N, C, HW, HW), "benign"),
    CatalogueModel("broadcast_parameters", BroadcastParameters, _x(N, D), "benign"),
    CatalogueModel("unbatched_mask_input", MaskInput,
                   lambda: (_x(N, T, D)(), torch.ones(T, T, dtype=torch.bool).triu(1)), "benign"),
    CatalogueModel("position_ids_1_T", PositionIds,
                   lambda: (_x(N, T, long=True)(), torch.arange(T).unsqueeze(0)), "benign"),
    CatalogueModel("time_major_lstm_batch_dim_1", TimeMajorLSTM, _x(T, N, D), "benign", batch_dim=1),
    CatalogueModel("conv_net", ConvNet, _x(N, C, HW, HW), "benign"),
    CatalogueModel("keyword_inputs", KeywordInputs,
                   lambda: {"x": _x(N, D)(), "bias": torch.ones(D), "scale": 2.0}, "benign"),
    CatalogueModel("two_inputs", TwoInputs, lambda: (_x(N, D)(), _x(N, 5)()), "benign"),
    CatalogueModel("mha_batch_first_padding_mask", MHABatchFirst,
                   lambda: (_x(N, T, D)(), torch.zeros(N, T, dtype=torch.bool)), "benign"),
    CatalogueModel("lstm_batch_first", LSTMBatchFirst, _x(N, T, D), "benign"),
    CatalogueModel("embedding_mean_over_time", EmbeddingMean, _x(N, T, long=True), "benign"),
    CatalogueModel("batchnorm_eval", _eval(BatchNormEval), _x(N, D), "benign"),
    CatalogueModel("pick_per_sample_arange", PickPerSample,
                   lambda: (_x(N, D)(), torch.tensor([0, 4, 2, 1])), "benign"),
    CatalogueModel("per_sample_feature_ops", FeatureOps, _x(N, D), "benign"),
    CatalogueModel("transformer_encoder_layer", EncoderLayer, _x(N, T, D), "benign"),
    CatalogueModel("time_major_mha_batch_dim_1", TimeMajorMHA, _x(T, N, D), "benign", batch_dim=1),
    CatalogueModel("einsum_per_sample", EinsumPerSample, _x(N, T, D), "benign"),
    CatalogueModel("class_token_expand_cat", ClassToken, _x(N, T, D), "benign"),
    CatalogueModel("gather_per_sample", GatherPerSample,
                   lambda: (_x(N, D)(), torch.zeros(N, 2, dtype=torch.long)), "benign"),
    CatalogueModel("sdpa_per_sample", SDPAPerSample, _x(N, T, D), "benign"),
    CatalogueModel("write_per_sample_columns", WritePerSampleColumns, _x(N, D), "benign"),
    # moves the batch
    CatalogueModel("transpose_0_1", Transpose01, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("permute", Permute, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("movedim", Movedim, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("swapaxes", Swapaxes, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("dot_T_2d", TransposeT, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("dot_mT_2d", TransposeMT, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("reshape_merge_n_t", ReshapeMerge, _x(N, T, D), "moves", (_move(BatchLayout.merged(0, T)),)),
    CatalogueModel("time_major_merge_then_view_split", TimeMajorMergeSplit, _x(N, T, D), "moves",
                   (_move(BatchLayout.at(1), "MOVE transpose"), _move(BatchLayout.merged(0, 1), "MOVE merge"),
                    _move(BatchLayout.at(1), "MOVE split"))),
    CatalogueModel("unsqueeze_0", Unsqueeze0, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("flatten_0_1", Flatten01, _x(N, T, D), "moves", (_move(BatchLayout.merged(0, T)),)),
    CatalogueModel("permuted_image", PermutedImage, _x(N, C, HW, HW), "moves", (_move(BatchLayout.at(2)),)),
    CatalogueModel("stack_two_views", StackTwoViews, _x(N, D), "moves", (_move(BatchLayout.at(1)),)),
    CatalogueModel("cat_two_views_along_batch", CatTwoViews, lambda: (_x(N, D)(), _x(N, D)() + 1), "moves",
                   (_move(BatchLayout.merged(0, 1)),)),
    CatalogueModel("view_features_into_rows", FeaturesIntoRows, _x(N, 2 * D), "moves",
                   (_move(BatchLayout.merged(0, 2)),)),
    CatalogueModel("time_major_gru", TimeMajorRNN, _x(N, T, D), "moves", (_move(BatchLayout.at(1)),)),
    # mixes samples
    CatalogueModel("center_with_batch_mean", CenterWithBatchMean, _x(N, D), "mixes", MIX),
    CatalogueModel("full_sum", FullSum, _x(N, D), "mixes", MIX),
    CatalogueModel("max_over_batch", MaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("min_over_batch", MinOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("std_over_batch", StdOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("var_over_batch", VarOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("norm_over_batch", NormOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("logsumexp_over_batch", LogSumExpOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("prod_over_batch", ProdOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("amax_over_batch", AmaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("batchnorm_training", BatchNormTraining, _x(N, D), "mixes", MIX),
    CatalogueModel("functional_batch_norm_training", FunctionalBatchNorm, _x(N, D), "mixes", MIX),
    CatalogueModel("softmax_over_batch", SoftmaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("log_softmax_over_batch", LogSoftmaxOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("cumsum_over_batch", CumsumOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("cumprod_over_batch", CumprodOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("sort_over_batch", SortOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("argsort_over_batch", ArgsortOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("topk_over_batch", TopkOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("roll_over_batch", RollOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("flip_over_batch", FlipOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("matmul_contracting_batch", AdjacencyMatmul, _x(N, D), "mixes", MIX),
    CatalogueModel("einsum_contracting_batch", GramEinsum, _x(N, D), "mixes", MIX),
    CatalogueModel("bmm_contracting_batch", BmmOverBatch, _x(N, T, D), "mixes", MIX),
    CatalogueModel("pairwise_differences", PairwiseDifferences, _x(N, D), "mixes", MIX),
    CatalogueModel("cat_with_shared_row_along_batch", CatSharedRow, _x(N, D), "mixes", MIX),
    CatalogueModel("first_sample_broadcast", FirstSampleBroadcast, _x(N, D), "mixes", MIX),
    CatalogueModel("shuffle_by_index_tensor", ShuffleByIndex, _x(N, D), "mixes", MIX),
    CatalogueModel("index_select_batch", IndexSelectBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("gather_along_batch", GatherBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("normalize_over_batch", NormalizeOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("layer_norm_over_batch", LayerNormOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("conv_batch_in_channels", ConvBatchInChannels, _x(N, 7), "mixes", MIX),
    CatalogueModel("linear_on_batch_features", LinearOnBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("lstm_wrong_batch_first", LSTMWrongBatchFirst, _x(N, T, D), "mixes", MIX),
    CatalogueModel("mha_wrong_batch_first", MHAWrongBatchFirst, _x(N, T, D), "mixes", MIX),
    CatalogueModel("loss_inside_model", LossInsideModel, lambda: (_x(N, D)(), torch.tensor([0, 1, 2, 3])),
                   "mixes", MIX),
    CatalogueModel("consecutive_difference", ConsecutiveDifference, _x(N, D), "mixes", MIX),
    CatalogueModel("chunk_batch", ChunkBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("cdist_pairs", CdistPairs, _x(N, D), "mixes", MIX),
    CatalogueModel("attention_over_batch", AttentionOverBatch, _x(N, D), "mixes", MIX),
    CatalogueModel("write_across_samples", WriteAcrossSamples, _x(N, D), "mixes", MIX),
]


def by_category(category: str) -> List[CatalogueModel]:
    """The entries of one category: "benign", "moves" or "mixes"."""
    if category not in ("benign", "moves", "mixes"):
        raise ValueError(f"unknown category {category!r}")
    return [e for e in CATALOGUE if e.category == category]


def by_name(name: str) -> CatalogueModel:
    for e in CATALOGUE:
        if e.name == name:
            return e
    raise KeyError(name)
