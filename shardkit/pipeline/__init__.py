"""Pipeline parallelism: the layer stack cut into stages over the `pipeline` mesh axis, run inside a shard_map.

    schedule.py     the shape of a schedule (`PipelineConfig`), its grids of ticks, sends and bubble math
    config.py       a layout's pipeline, resolved and checked once; its region (manual axes, rules, dropout streams)
    sends.py        the collectives written by hand: `send` (ppermute), `psum`, `to_varying`
    gpipe.py        GPipe and circular: the `layer_loop` that replaces the model's scan over layers
    program.py      the tick program: a schedule's grid as the tables the tick executor runs (actions, buffer slots)
    one_f_one_b.py  the tick executor: loss and gradients computed stage by stage (1f1b, interleaved_1f1b, zero_bubble)
    chart.py        what `shardkit plan` shows: the summary and text/SVG Gantt charts

The names other modules use are exported here.
"""

from shardkit.pipeline.chart import (
    format_pipeline_summary,
    pipeline_summary,
    svg_gantt,
    text_gantt,
    write_svg_gantt,
)
from shardkit.pipeline.config import (
    PipelineBubbleWarning,
    PipelineRegion,
    manual_data_axes,
    microbatch_activation_bytes,
    pipeline_config,
    pipeline_region,
    validate_pipeline,
)
from shardkit.pipeline.gpipe import layer_loop_for
from shardkit.pipeline.schedule import (
    CHUNKED_SCHEDULES,
    TICK_SCHEDULES,
    Pairs,
    PipelineConfig,
    Work,
    boundary_sends,
    bubble_fraction,
    collective_permute_bytes,
    forward_grid,
    forward_sends,
    gpipe_grid,
    idle_fraction,
    interleaved_grid,
    one_f_one_b_grid,
    peak_live_activations,
    schedule_grid,
    tick_runs,
    zero_bubble_grid,
)
from shardkit.pipeline.sends import send
