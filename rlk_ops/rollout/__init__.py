"""Rollout side: paged KV cache manager, rollout loop, the train-vs-rollout demo."""
