"""The duplicate-mode (HARTS) microbatch planner: whole trajectories grouped into microbatches, DP replicas and slots.

  plan.py       `plan_microbatches`, the search and the plan it returns (`MicrobatchPlan`)
  search.py     contiguous partitions of the lexicographic order: natural partition, K range, exact DP, K evolution
  greedy.py     trie-aware greedy construction
  refine.py     local refinement and elimination of a grouping
  balance.py    balancing by moving atoms, without adding compact work
  flat.py       auto mode's choice of each microbatch's execution: its trie or its flat expansion
  baselines.py  peer microbatch planners, for comparison only (bench/planner.py)
"""
