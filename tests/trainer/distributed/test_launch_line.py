"""The launch line and the `accelerate launch --num_processes N` that started one process (trainer/distributed/launch_info.py)."""
import torch

from trainer.distributed.launch_info import describe_launch, device_text, launch_mismatch, requested_processes

# What accelerate's simple launcher exports for --num_processes 2 on a CPU machine (prepare_simple_launcher_cmd_env)
SIMPLE_2 = {"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "ACCELERATE_MIXED_PRECISION": "no"}
PARENT = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "-m", "trainer.train",
          "recipes/grpo_tiny.yaml"]


def test_one_line_names_processes_backend_device_dtype_recipe_engine():
    line = describe_launch(world=1, backend=None, device=device_text(torch.device("cpu")), dtype="bfloat16",
                           precision="bf16", engine="vllm (colocated)")
    assert line == ("launch: 1 process (backend none) on cpu; model.dtype bfloat16, precision.recipe bf16, "
                    "engine vllm (colocated)")
    assert "\n" not in line
    two = describe_launch(world=2, backend="gloo", device=device_text(torch.device("cpu", 0)), dtype="float32",
                          precision="exact", engine="hf")
    assert two == "launch: 2 processes (backend gloo) on cpu; model.dtype float32, precision.recipe exact, engine hf"
    gpus = describe_launch(world=8, backend="nccl", device="cuda:0 (NVIDIA H100 80GB HBM3)", dtype="bfloat16")
    assert gpus == ("launch: 8 processes (backend nccl) on cuda:0 (NVIDIA H100 80GB HBM3) on rank 0, one device per "
                    "process; model.dtype bfloat16")  # sft / train-rm: no precision recipe or engine


def test_requested_processes_reads_both_spellings():
    assert requested_processes(PARENT) == 2
    assert requested_processes(["accelerate", "launch", "--num_processes=8", "-m", "x"]) == 8
    assert requested_processes(["accelerate", "launch", "-m", "trainer.train"]) is None


def test_asked_for_two_got_one_says_so_and_how():
    msg = launch_mismatch(1, SIMPLE_2, PARENT)
    assert msg.startswith("warning: accelerate launch was asked for --num_processes 2 but started 1")
    assert "--config_file recipes/accelerate/ddp.yaml" in msg and "torchrun --nproc_per_node N" in msg
    # unknown parent (no /proc): still warns, without a number
    assert "asked for several processes" in launch_mismatch(1, SIMPLE_2, [])


def test_no_warning_when_the_launch_got_what_it_asked():
    assert launch_mismatch(2, SIMPLE_2, PARENT) is None  # the process group has 2
    assert launch_mismatch(1, {**SIMPLE_2, "WORLD_SIZE": "1"}, PARENT) is None  # torchrun's single process
    assert launch_mismatch(1, {}, []) is None  # plain `parityrl train`
    single = ["accelerate", "launch", "--num_processes", "1", "-m", "trainer.train", "r.yaml"]
    assert launch_mismatch(1, SIMPLE_2, single) is None
    # MASTER_ADDR exported by a cluster's environment, accelerate not asked for several processes
    assert launch_mismatch(1, SIMPLE_2, ["accelerate", "launch", "-m", "trainer.train", "r.yaml"]) is None


def test_the_launch_line_says_the_precision_recipes_account_of_the_dtype():
    from trainer.distributed.launch_info import launch_lines
    from trainer.lifecycle.preflight import load_recipe
    from trainer.precision import recipe_for

    cfg = load_recipe("recipes/grpo_tiny.yaml", ["model.dtype=float32"], check_paths=False)
    line = launch_lines(cfg, 1, torch.device("cpu"), recipe_for("bf16").dtype_reason)
    assert "model.dtype float32, precision.recipe bf16 (both phases run in model.dtype)" in line
