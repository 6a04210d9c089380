"""The prefix-carry planner: trees cut into parts, every unique row executed once, also when a tree exceeds capacity.

  plan.py      `plan_carry`, the plan it returns (`CarryPlan`) and its guarantees
  balance.py   planning units (rank ranges of pack's order) and their DP replicas
  rows.py      a unit's rows from pack's sorted order and adjacent LCPs, without building its trie
  slots.py     the microbatches of one DP replica: which rows of which unit each slot runs
  events.py    what parts read from each other, and the forward/backward events every replica runs
"""
