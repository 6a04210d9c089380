"""The linear-attention call planner of one microbatch (HARTS §3.3-3.4).

  segment_tree.py  the fork structure of a rollout forest, one vertex per maximal fork-free token path
  min_calls.py     HARTS Algorithm 1: the minimum number of sequential calls and how to attain it
  schedule.py      sequences and rounds: which segments share a packed input sequence, and when each one runs
  plan.py          `plan_calls`: the `ExecutionPlan` the layers run on the compact rows
"""
