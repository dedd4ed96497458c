"""The intra-op solver: every op's placements on one (sub)mesh, by an ILP.

Where it sits: solver/, after tracing (a frozen Graph) and before the whole-plan search
(solver/pipeline_search.py, its one-stage candidates in solver/spmd_search.py) and
codegen. The modules, in the order one solve runs them (`ilp.solve_intra_op` calls space,
restrict, the cost table, sharing, then builds the ILP, solves it and reads the solution):
- space.py         `enumerate_strategies(graph, mesh_shape) -> StrategySpace`: each node's
                   Shard/Replicate/Partial choices, from DTensor's registry
- restrict.py      a forced configuration's layouts (`restrict_placeholders`) and the
                   strategies no plan reaches without gathering on a data-parallel axis
                   (`prune_gather_free`): infeasible options removed, not priced
- (prices)         `cost_model.cost_table(graph, space, cluster) -> CostTable`: compute,
                   resharding, gradient sync and memory of every strategy, handed over as
                   data by the cost model (cost_model/table.py)
- sharing.py       `reduce_graph`: layer sharing and strategy following, so the ILP grows
                   with one layer, not with depth
- ilp.py           `solve_intra_op(graph, cluster, mesh_shape) -> IntraOpSolution`: the ILP
                   (its math in its docstring), one function per constraint family
- liveness.py      which tensors the memory rows count, and when (also solver/stage_costs.py's)
- collective_groups.py  grouped weight gathers and gradient buckets, priced as the program
                   runs them: the objective's and the solution's share of one latency
- overlap_rows.py  the collectives hidden behind compute (one variable per pool, its rows),
                   where the program overlaps them
- backend.py       running HiGHS or CBC: one thread, fixed seed, LP relaxation first,
                   native solver output kept off stdout
- solution.py      the chosen strategies priced again into costs and collectives

Nothing is re-exported here: import from the module that defines a name.
"""
