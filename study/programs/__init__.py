"""Reading programs: what a traced step (its jaxpr) and a compiled one (its HLO) tag, save,
offload and address; the proofs of placement and of addressing."""
