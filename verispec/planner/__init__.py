"""How many drafts each request verifies per step: the goodput planner, the fixed-K planner, the step cost."""
