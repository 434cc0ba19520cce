"""Exercises that check themselves: each ``check_*`` runs the reader's function through the
package on more seeds and shapes than the chapter tried and returns a ``Result``: ``.passed`` and
one short paragraph saying what is right or wrong and which chapter explains it. One module per
part of the book; ``graders`` holds what they share. ``import tpattn`` does not import this."""
from tpattn.exercises.at_scale import (check_classify, check_relative_bound,
                                       check_shard_concat_qkv, check_shard_fused_qkv)
from tpattn.exercises.dense_block import check_five_measures, check_train_step
from tpattn.exercises.graders import CHECKED_CONFIGS, CHECKED_SEEDS, WIDTH, Result
from tpattn.exercises.in_the_wild import (HUNTS, check_bias_once, check_dp_grad_sync,
                                          check_dropout_streams, check_forward_visible,
                                          check_hunts, check_ledger_verdict,
                                          check_load_grouped_qkv, check_loading_verdict,
                                          check_logged_loss, check_qk_norm_grad_reduce,
                                          check_qk_norm_hits, check_rng_resync,
                                          check_sp_gather_group, check_sp_gather_tokens,
                                          hunt_evidence)
from tpattn.exercises.loss_curve import check_leaves, check_step_one
from tpattn.exercises.real_ranks import (check_bytes_per_step, check_kv_grad_reduce,
                                         check_ledger_counts, check_missing_kv_parameters,
                                         check_norm_grad_reduce, check_real_f_and_g,
                                         check_rope_offset)
from tpattn.exercises.splitting import (check_diagnose, check_fingerprint, check_gate_up_shards,
                                        check_keeps_groups, check_missing_f_parameters,
                                        check_missing_f_signature, check_missing_g_signature,
                                        check_separating_measures, check_shard_params,
                                        check_tp_mlp)
from tpattn.exercises.whole_model import (check_gathered_ce_offset, check_head_f_measures,
                                          check_vocab_lookup)

__all__ = [
    "Result", "CHECKED_SEEDS", "CHECKED_CONFIGS", "HUNTS", "hunt_evidence",
    "check_train_step", "check_five_measures", "check_shard_params", "check_keeps_groups",
    "check_tp_mlp", "check_gate_up_shards", "check_missing_g_signature", "check_fingerprint",
    "check_missing_f_signature", "check_missing_f_parameters", "check_separating_measures",
    "check_diagnose", "check_bytes_per_step", "check_ledger_counts", "check_real_f_and_g",
    "check_norm_grad_reduce", "check_rope_offset", "check_kv_grad_reduce",
    "check_missing_kv_parameters", "check_relative_bound", "check_classify",
    "check_shard_concat_qkv", "check_shard_fused_qkv", "check_bias_once",
    "check_forward_visible", "check_ledger_verdict", "check_hunts", "check_dropout_streams",
    "check_rng_resync", "check_qk_norm_grad_reduce", "check_qk_norm_hits", "check_dp_grad_sync",
    "check_logged_loss", "check_sp_gather_group", "check_sp_gather_tokens",
    "check_load_grouped_qkv", "check_loading_verdict",
    "check_vocab_lookup", "check_head_f_measures", "check_gathered_ce_offset",
    "check_leaves", "check_step_one",
]
