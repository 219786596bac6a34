"""The Recipe line under the table: where a fine-tuning recipe puts its bytes
(report/table_notes.py: recipe_line)."""

from __future__ import annotations

from boom_ml.report.table import recipe_line


def test_recipe_line_names_where_the_bytes_go() -> None:
    assert recipe_line({"finetune": "full", "bytes": {}}) == ""
    line = recipe_line(
        {
            "finetune": "qlora",
            "nf4_layers": 224,
            "lora_targets": ["q_proj", "v_proj"],
            "peft_trainable_parameters": 3_407_872,
            "bytes": {
                "base_weights_4bit": 3 * 2**30,
                "trainable_parameters": 6_815_744,
                "optimizer_state_on_host": 2**30,
            },
        }
    )
    assert line == (
        "Recipe: base weights 4-bit NF4 3.00 GiB (224 layers); LoRA adapters 3.4 M trainable "
        "(6.5 MiB, targets q_proj,v_proj); optimizer state on the host 1.00 GiB."
    )
    moe = recipe_line({"finetune": "qlora", "params_dtype": "bf16", "bytes": {},
                       "unquantized_expert_parameters": 45_097_156_608})  # fmt: skip
    assert moe.startswith(
        "Recipe: MoE expert weights not quantised 45.10 B parameters (bf16); LoRA"
    )
    # a count below a billion reads as one (786,432 had read "0.00 B" beside MiB figures)
    few = recipe_line({"finetune": "qlora", "params_dtype": "fp32", "bytes": {},
                       "unquantized_expert_parameters": 786_432})  # fmt: skip
    assert few.startswith("Recipe: MoE expert weights not quantised 0.8 M parameters (fp32);")
    # a hunt: 46,080 adapter parameters had read 0.0 M, and one NF4 layer "(1 layers)"
    small = recipe_line({"finetune": "qlora", "nf4_layers": 1, "lora_targets": ["fc"],
                         "peft_trainable_parameters": 46_080,
                         "bytes": {"base_weights_4bit": 2**20, "trainable_parameters": 184_320}})  # fmt: skip
    assert small == ("Recipe: base weights 4-bit NF4 1.0 MiB (1 layer); LoRA adapters 46.1 K"
                     " trainable (0.2 MiB, targets fc).")  # fmt: skip
    # below a GiB in MiB: 2 MiB on the host had read "0.00 GiB" (a hunt)
    host = recipe_line({"finetune": "lora", "bytes": {"optimizer_state_on_host": 2_052_096}})
    assert host.endswith("; optimizer state on the host 2.0 MiB.")
