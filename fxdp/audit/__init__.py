"""Privacy auditing with one training run: an empirical lower bound on epsilon (see docs/audit.md)."""

from fxdp.audit.bound import AuditResult, Guesses, best_guesses, epsilon_lower_bound, guess_grid, p_value

__all__ = ["AuditResult", "Guesses", "best_guesses", "epsilon_lower_bound", "guess_grid", "p_value"]
