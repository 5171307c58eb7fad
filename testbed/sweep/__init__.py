"""`testbed sweep`: a what-if experiment over what a run depends on (docs/sweep.md).

One concept per module:
  spec    the sweep file (YAML) or the command line's options, validated (pydantic)
  plan    the points (a grid or a list) and their runs, what each point changes, the estimate
  runner  brings the testbed to each point (a fresh `up`, or the links reconfigured in place),
          runs the job, judges it; the sweep directory it keeps (resumable)
  table   the results as one table (CSV and JSON)
  plots   iteration time against the swept parameter; a heatmap for two parameters

Layer: beside the CLI and the main job (testbed.mainjob), which it reuses.
"""
