"""The `duplexpipe` command's help texts: what each command does, examples and exit codes."""

from __future__ import annotations

from types import MappingProxyType

SCHEDULE_ARG = ("a built-in schedule (see 'duplexpipe schedules'; needs -p and -m) or a schedule file: "
                ".json (duplexpipe's, as 'export --format json' writes) or .csv (the schedule CSV that "
                "torch.distributed.pipelining writes and reads)")
SCHEDULES_ARG = ("built-in schedules and schedule files to compare (default: every built-in schedule that "
                 "accepts -p and -m); files carry their own P and M")

COSTS = """\
Costs are in one arbitrary time unit. By default (--costs-per model-part) F, B and W are the times of
1/P of the model, what one rank holds in 1F1B: a schedule that cuts the model into S stages on P ranks
(interleaved 1F1B, ZB-V, DualPipeV: S > P) runs each stage for P/S of them, so simulate and compare
agree and schedules compare on one model (CostModel.stage_scale). --costs-per stage takes them as
the times of one stage, whatever its size. --stage-cost overrides some stages, in the same convention
(stage numbers as in the actions 'duplexpipe show' prints: 3F0 is stage 3's forward)."""

_EXIT_BAD = ("2 bad input (one line on stderr: an unknown schedule, bad P or M,\n"
             "a malformed file or option, an unwritable output)")

DESCRIPTIONS = MappingProxyType({
    "duplexpipe": "Pipeline schedules as data: generate, verify, simulate, compare, draw, export, plan and train.",
    "schedules": "List the built-in schedules: one line each with its constraints and its --opt options.",
    "show": "Print a schedule's rank x step grid: one row per rank, a rank's n-th action in column n\n"
            "(F forward, B backward, I input-gradient, W weight-gradient, a&b an overlapped F&B pair).",
    "verify": "Check a schedule: every (stage, microbatch) has its F and B (or I and W) on the right rank\n"
              "in a valid order, sends and receives match, and no rank can block forever (deadlock).",
    "simulate": "Time a schedule under a cost model: makespan, bubble ratio (idle share) and per-rank busy,\n"
                "idle and peak live activations; optionally a Gantt chart and a Perfetto trace.",
    "compare": "Simulate several schedules on one model and cost model and tabulate makespan, bubble,\n"
               "peak activations (per rank and in memory units) and parameters per rank.",
    "export": "Write a schedule (built-in or file) as duplexpipe JSON or as torch.distributed.pipelining CSV.",
    "plot": "Draw a timeline file as a Gantt chart: a measured run ('duplexpipe train --out-dir DIR' writes\n"
            "DIR/timeline.json) or any Timeline.to_dict() JSON.",
    "train": "Train a task (a model and its data) with a pipeline schedule: on ranks x dp local processes, or as\n"
             "one rank under torchrun. Every setting is a flag and a key of the --config TOML file; each flag's\n"
             "help is its config field's docstring. Configuration errors are found before any process starts.",
    "plan": "Choose the schedule, microbatches, ZeRO stage and gradient compression for a model under a memory\n"
            "cap per rank: every candidate is simulated with the costs of a profile ('duplexpipe profile') and\n"
            "ranked by predicted step time. A profile made with 'profile --calibrate' includes the runtime's own\n"
            "work per action, message and step; without it the times are the parts' compute alone.",
    "profile": "Measure a task's model parts (forward, input- and weight-gradient times, activation, parameter and\n"
               "message bytes) on one microbatch and write a profile for 'duplexpipe plan'. --calibrate also\n"
               "trains the parts on --ranks local processes to measure the runtime's overhead and the compute\n"
               "scale inside a running pipeline (as schedule='auto' does), so plan's figures include them.",
    "checkpoint": "Check the checkpoints 'duplexpipe train --save' and Pipeline.save write (ACTION: verify).",
    "checkpoint verify": "Check a checkpoint without loading it: every file against the SHA-256 its manifest\n"
                         "recorded when it was saved, the metadata read the safe way (no code runs: only\n"
                         "checkpoint metadata classes are admitted), every tensor's size held by the bytes its\n"
                         "data files hold, and every data file the metadata points at present, inside the folder\n"
                         "and long enough; and what resume refuses whatever the model (the stage-keyed format 1,\n"
                         "missing trainer entries).",
})

EPILOGS = MappingProxyType({
    "duplexpipe": """\
examples:
  duplexpipe schedules
  duplexpipe show dualpipe -p 4 -m 8
  duplexpipe verify dualpipe -p 8 -m 32 --nccl
  duplexpipe simulate zb-h1 -p 8 -m 32 --cost F=1,B=2,W=1,latency=0.1 --plot zb.png --trace zb.json
  duplexpipe compare -p 4 -m 8 --plot compare.png
  duplexpipe export dualpipev -p 4 -m 8 --format torch-csv -o dualpipev.csv
  duplexpipe train --schedule dualpipe --ranks 4 --steps 50 --out-dir run/
  duplexpipe plot run/timeline.json -o run.png
  duplexpipe profile --parts 8 --calibrate --ranks 4 --batch 32 -o profile.json
  duplexpipe plan --profile profile.json -p 4 --batch 32 --memory 2GiB
  duplexpipe checkpoint verify run/ckpt

'duplexpipe COMMAND --help' explains each command.
exit codes: 0 ok, 1 unsound schedule (verify) or a failed training rank, 2 bad input""",
    "schedules": """\
example:
  duplexpipe schedules

exit codes: 0 ok""",
    "show": f"""\
examples:
  duplexpipe show 1f1b -p 4 -m 8
  duplexpipe show dualpipe -p 4 -m 8 --comms            # with the SEND/RECV the runtime posts
  duplexpipe show interleaved-1f1b -p 4 -m 8 --opt chunks=3
  duplexpipe show my_schedule.json

exit codes: 0 printed, {_EXIT_BAD}""",
    "verify": f"""\
examples:
  duplexpipe verify dualpipe -p 8 -m 32
  duplexpipe verify my_schedule.json --nccl             # also the per-pair message order NCCL needs
  duplexpipe verify torch_dump.csv                      # a schedule CSV from torch's pipelining

exit codes: 0 sound ("OK ..." on stdout), 1 unsound ("UNSOUND ..." on stdout, naming the missing,
misplaced or blocked actions rank by rank), {_EXIT_BAD}""",
    "simulate": f"""\
examples:
  duplexpipe simulate zb-h1 -p 8 -m 32 --cost F=1,B=2,W=1,latency=0.1
  duplexpipe simulate 1f1b -p 4 -m 8 --stage-cost 3:F=1.5,B=3        # a heavy last stage
  duplexpipe simulate interleaved-1f1b -p 4 -m 8 --opt chunks=4 --costs-per stage
  duplexpipe simulate dualpipe -p 64 -m 512 --plot dp.png --ranks-shown 0-7,56-63 --window 0:300
  duplexpipe simulate my_schedule.json --json --trace my.trace.json   # open in ui.perfetto.dev

exit codes: 0 ok, {_EXIT_BAD} or a schedule that cannot run""",
    "compare": f"""\
examples:
  duplexpipe compare -p 4 -m 8                          # every built-in schedule that accepts P and M
  duplexpipe compare 1f1b zbv my_schedule.json -p 4 -m 8 --plot compare.png
  duplexpipe compare 1f1b interleaved-1f1b -p 8 -m 32 --opt chunks=4 --json

A schedule named on the command line that rejects P or M is bad input; with no names such
schedules are listed as skipped.
exit codes: 0 ok, {_EXIT_BAD}""",
    "export": f"""\
examples:
  duplexpipe export dualpipe -p 4 -m 8 --format json -o dualpipe.json
  duplexpipe export zbv -p 4 -m 8 --format torch-csv -o zbv.csv --comms   # lowered: with SEND/RECV
  duplexpipe export dualpipe.json --format json -o lowered.json --comms   # convert or lower a file

torch CSV has no stage table: schedules with two model copies (dualpipe) are refused; use json.
exit codes: 0 written, {_EXIT_BAD}""",
    "train": """\
examples:
  duplexpipe train --schedule dualpipe --ranks 4 --steps 50 --out-dir run/
  duplexpipe train --schedule interleaved-1f1b --opt chunks=2 --ranks 2 --microbatches 4
  duplexpipe train --schedule mine.json                  # a schedule file: its ranks and microbatches
  duplexpipe train --task hf --task-option model=DIR --task-option data=notes.txt --schedule 1f1b \\
      --ranks 2 --eval-every 20 --save-pretrained tuned/
  duplexpipe train --config run.toml --accumulation-steps 4 --no-fb-overlap

the gpt task's options (--task-option KEY=VALUE): {gpt}
the hf task's options (--task-option KEY=VALUE):
{hf}

exit codes: 0 trained, 1 a rank failed (its error in one line), 2 bad input (one line on stderr: a setting,
a task, a schedule that cannot run, a checkpoint that does not match), 130 interrupted""",
    "plan": """\
examples:
  duplexpipe profile --parts 8 --microbatch 4 -o profile.json
  duplexpipe profile --parts 8 --microbatch 4 --calibrate --ranks 4 --batch 32 -o profile.json
  duplexpipe plan --profile profile.json -p 4 --batch 64 --memory 2GiB
  duplexpipe plan --profile profile.json -p 4 --dp 2 --batch 128 --memory 40GiB --bandwidth 25GB \\
      --zero 0,1,2 --compression all --json
  duplexpipe plan --profile profile.json -p 4 --batch 64 --memory 2GiB --plot pareto.png
  duplexpipe plan --profile profile.json --world 8 --batch 64 --memory 40GiB --tp-bandwidth 150GB
  duplexpipe plan --profile profile.json --world 8 --tp 2 --sequence-parallel --batch 64 --memory 40GiB

exit codes: 0 planned, 2 bad input (one line on stderr: a profile that cannot be read, a bad size or mesh,
no candidate under the cap, an unwritable figure)""",
    "profile": """\
examples:
  duplexpipe profile --parts 8 --microbatch 4 -o profile.json                  # the bundled GPT
  duplexpipe profile --task my_task.py:task --parts 8 -o profile.json
  duplexpipe profile --task hf --task-option model=DIR --task-option data=notes.txt --parts 4 -o hf.json
  duplexpipe profile --parts 8 --calibrate --ranks 4 --batch 32 -o profile.json

exit codes: 0 written, 2 bad input (one line on stderr: a task that cannot be imported, built or split, a bad
option, an unwritable output); with --calibrate, 1 when a rank fails""",
    "checkpoint": """\
example:
  duplexpipe checkpoint verify run/ckpt/step-000030

'duplexpipe checkpoint verify --help' explains the action.
exit codes: see the action""",
    "checkpoint verify": """\
examples:
  duplexpipe checkpoint verify run/ckpt/step-000030     # one checkpoint
  duplexpipe checkpoint verify run/ckpt                 # the one run/ckpt/latest names
  duplexpipe checkpoint verify run/ckpt --all           # every step-NNNNNN in run/ckpt

exit codes: 0 intact ("OK ..." on stdout), 1 damaged ("DAMAGED ..." on stdout naming the first file
that is missing, truncated or changed, then one line per further problem; also a checkpoint without a
manifest, whose files cannot be checked), 2 bad input (one line on stderr: not a folder, not a
checkpoint, a 'latest' file naming none)""",
    "plot": """\
examples:
  duplexpipe plot run/timeline.json                     # writes run/timeline.png
  duplexpipe plot run/timeline.json -o run.svg --ranks-shown 0,3 --window 0:250

--window is in the units of the figure's time axis (ms or s for measured runs, as its label says).
exit codes: 0 written, 2 bad input (one line on stderr: a missing or malformed timeline file, a rank
or window outside the run, an unwritable output, matplotlib missing)""",
})
