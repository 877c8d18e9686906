"""Measuring a policy: grouped validation with pass@j (validation), majority voting (voting),
and paired comparisons of two policies (paired). It is handed a scorer
(scorer.Scorer) and imports only model/ and runtime/."""
