"""The placement search: the fast time model that ranks candidates (ranking.py), and the search
as `python -m study search` runs it, from traced inputs to its report (placements.py)."""
