"""Privacy auditing with one training run (Steinke, Nasr & Jagielski, NeurIPS 2023): an empirical lower
bound on epsilon, to set beside the accountant's claim. See docs/audit.md.

    result = fxdp.audit.one_run(model, train_set, noise_multiplier=1.0, max_grad_norm=1.0,
                                batch_size=64, epochs=2, canaries=1000)
    print(result)   # epsilon lower bound vs claimed, guesses, verdict

``bound`` holds the statistics (``math`` only), ``canaries`` the canaries and their scores,
``one_run`` the audited training run.
"""

from fxdp.audit.bound import AuditResult, Guesses, best_guesses, epsilon_lower_bound, guess_grid, p_value
from fxdp.audit.canaries import CanaryInputs, CanarySink
from fxdp.audit.one_run import one_run

__all__ = ["AuditResult", "CanaryInputs", "CanarySink", "Guesses", "best_guesses", "epsilon_lower_bound",
           "guess_grid", "one_run", "p_value"]
