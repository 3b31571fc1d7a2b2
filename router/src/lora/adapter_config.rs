//! A PEFT adapter directory checked before it is registered: its
//! `adapter_config.json` read, the rank held to `--max-lora-rank`, the
//! target modules among those the shard applies adapters to, the weights
//! file present. Every failure is a sentence naming the directory and what
//! is wrong with it.

use std::path::Path;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Projections an adapter may target (Llama-style names): attention and MLP;
/// `qkv_proj` and `gate_up_proj` are Phi-3's fused ones.
pub const TARGET_MODULES: [&str; 9] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"];
/// What `"all-linear"` targets.
const ALL_LINEAR: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// What registration needs from a directory that passed the checks.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedAdapter {
    pub rank: u32,
    pub target_modules: Vec<String>,
    pub fingerprint: String,
}

/// Reads and checks the adapter at `dir` against `max_rank`.
pub fn check_adapter_dir(dir: &Path, max_rank: u32) -> Result<CheckedAdapter, String> {
    let shown = dir.display();
    if !dir.is_dir() {
        return Err(format!(
            "{shown} is not a directory (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})"
        ));
    }
    let config_path = dir.join(CONFIG_FILE);
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| format!("cannot read {}: {e}", config_path.display()))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", config_path.display()))?;
    let checked = check_config(&config, max_rank).map_err(|e| format!("{shown}: {e}"))?;
    if !dir.join(WEIGHTS_FILE).is_file() {
        let hint = if dir.join("adapter_model.bin").is_file() {
            " (adapter_model.bin is not read: save the adapter with safe_serialization=True)"
        } else {
            ""
        };
        return Err(format!("{shown}: {WEIGHTS_FILE} is missing{hint}"));
    }
    Ok(CheckedAdapter { fingerprint: fingerprint(dir, &text)?, ..checked })
}

/// The checks on the parsed `adapter_config.json` (fingerprint left empty).
pub fn check_config(config: &Value, max_rank: u32) -> Result<CheckedAdapter, String> {
    let Some(obj) = config.as_object() else { return Err(format!("{CONFIG_FILE} is not a JSON object")) };
    if let Some(kind) = obj.get("peft_type").and_then(Value::as_str) {
        if !kind.eq_ignore_ascii_case("lora") {
            return Err(format!("peft_type is {kind:?}; only LORA adapters are served"));
        }
    }
    if obj.get("use_dora").and_then(Value::as_bool) == Some(true) {
        return Err("DoRA adapters (use_dora: true) are not served".into());
    }
    // Options that change the product or add weights beyond A and B (the shard refuses them too).
    let set = |key: &str| obj.get(key).is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)) && !is_empty(v));
    for (key, what) in [
        ("modules_to_save", "whole modules trained beside the adapter (modules_to_save)"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("lora_bias", "LoRA biases (lora_bias)"),
        ("fan_in_fan_out", "transposed (Conv1D) weights (fan_in_fan_out)"),
    ] {
        if set(key) {
            return Err(format!("{what} are not served"));
        }
    }
    if let Some(bias) = obj.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(format!("bias is {bias:?}: adapters that train biases are not served (bias must be \"none\")"));
        }
    }
    let rank = obj.get("r").and_then(Value::as_u64).ok_or("`r` (the rank) is missing or not a positive integer")?;
    if rank == 0 {
        return Err("rank `r` is 0".into());
    }
    if rank > max_rank as u64 {
        return Err(format!("rank {rank} exceeds --max-lora-rank {max_rank}"));
    }
    let target_modules = target_modules(obj.get("target_modules"))?;
    Ok(CheckedAdapter { rank: rank as u32, target_modules, fingerprint: String::new() })
}

/// `target_modules` as PEFT writes it: a list of module names (or dotted
/// paths ending in one), or `"all-linear"`; a single name as a string.
fn target_modules(v: Option<&Value>) -> Result<Vec<String>, String> {
    let names: Vec<String> = match v {
        None | Some(Value::Null) => return Err("target_modules is missing".into()),
        Some(Value::String(s)) if s == "all-linear" => ALL_LINEAR.iter().map(|m| m.to_string()).collect(),
        Some(Value::String(s)) if TARGET_MODULES.contains(&s.as_str()) => vec![s.clone()],
        Some(Value::String(s)) => {
            return Err(format!(
                "target_modules {s:?} is a pattern; list the modules by name (any of {})",
                TARGET_MODULES.join(", ")
            ))
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string).ok_or_else(|| format!("target_modules holds {i}, not a name")))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("target_modules is {other}, not a list of names")),
    };
    if names.is_empty() {
        return Err("target_modules is empty".into());
    }
    let mut out = Vec::new();
    for name in names {
        let short = name.rsplit('.').next().unwrap_or(&name);
        if !TARGET_MODULES.contains(&short) {
            return Err(format!("target module {name:?} is not one of {}", TARGET_MODULES.join(", ")));
        }
        if !out.iter().any(|m| m == short) {
            out.push(short.to_string());
        }
    }
    Ok(out)
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// SHA-256 over the config's text and each file's name, size and
/// modification time: changes when the adapter's files do.
fn fingerprint(dir: &Path, config_text: &str) -> Result<String, String> {
    let mut h = Sha256::new();
    h.update(config_text.as_bytes());
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let Ok(meta) = e.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        h.update(e.file_name().to_string_lossy().as_bytes());
        h.update(meta.len().to_le_bytes());
        h.update(modified.map_or(0, |d| d.as_nanos()).to_le_bytes());
    }
    Ok(h.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_plain_lora_config_passes_with_its_rank_and_targets() {
        let c = json!({"peft_type": "LORA", "r": 16, "lora_alpha": 16, "bias": "none", "rank_pattern": {},
            "target_modules": ["q_proj", "v_proj", "model.layers.0.mlp.down_proj"], "fan_in_fan_out": false});
        let got = check_config(&c, 64).unwrap();
        assert_eq!(got.rank, 16);
        assert_eq!(got.target_modules, ["q_proj", "v_proj", "down_proj"]);
        let all = check_config(&json!({"r": 4, "target_modules": "all-linear"}), 8).unwrap();
        assert_eq!(all.target_modules.len(), 7);
        let phi3 = check_config(&json!({"r": 4, "target_modules": ["qkv_proj", "gate_up_proj"]}), 8).unwrap();
        assert_eq!(phi3.target_modules, ["qkv_proj", "gate_up_proj"]);
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        for (config, needle) in [
            (json!({"r": 128, "target_modules": ["q_proj"]}), "exceeds --max-lora-rank 64"),
            (json!({"r": 8, "target_modules": ["q_proj"], "rank_pattern": {"k_proj": 4}}), "rank_pattern"),
            (json!({"r": 8, "target_modules": ["q_proj"], "alpha_pattern": {"k_proj": 4}}), "alpha_pattern"),
            (json!({"r": 8, "target_modules": ["q_proj"], "lora_bias": true}), "lora_bias"),
            (json!({"r": 8, "target_modules": ["q_proj"], "fan_in_fan_out": true}), "fan_in_fan_out"),
            (json!({"r": 8, "target_modules": ["lm_head"]}), "\"lm_head\" is not one of"),
            (json!({"r": 8, "target_modules": ".*proj"}), "is a pattern"),
            (json!({"r": 8}), "target_modules is missing"),
            (json!({"target_modules": ["q_proj"]}), "`r`"),
            (json!({"r": 0, "target_modules": ["q_proj"]}), "rank `r` is 0"),
            (json!({"r": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}), "only LORA"),
            (json!({"r": 8, "target_modules": ["q_proj"], "use_dora": true}), "DoRA"),
            (json!({"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}), "modules_to_save"),
            (json!({"r": 8, "target_modules": ["q_proj"], "bias": "all"}), "bias"),
            (json!([1]), "not a JSON object"),
        ] {
            let err = check_config(&config, 64).unwrap_err();
            assert!(err.contains(needle), "{config}: {err}");
        }
        assert!(check_config(&json!({"r": 8, "target_modules": ["q_proj"], "modules_to_save": null}), 64).is_ok());
    }

    #[test]
    fn a_directory_needs_its_config_and_safetensors() {
        let dir = std::env::temp_dir().join(format!("pagemill-lora-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(check_adapter_dir(&dir, 64).unwrap_err().contains("not a directory"));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(check_adapter_dir(&dir, 64).unwrap_err().contains("cannot read"));
        std::fs::write(dir.join(CONFIG_FILE), "{not json").unwrap();
        assert!(check_adapter_dir(&dir, 64).unwrap_err().contains("not valid JSON"));
        std::fs::write(dir.join(CONFIG_FILE), r#"{"r": 8, "target_modules": ["q_proj"]}"#).unwrap();
        std::fs::write(dir.join("adapter_model.bin"), b"x").unwrap();
        assert!(check_adapter_dir(&dir, 64).unwrap_err().contains("safe_serialization"));
        std::fs::write(dir.join(WEIGHTS_FILE), b"x").unwrap();
        let first = check_adapter_dir(&dir, 64).unwrap();
        assert_eq!((first.rank, first.fingerprint.len()), (8, 32));
        std::fs::write(dir.join(WEIGHTS_FILE), b"xy").unwrap();
        assert_ne!(check_adapter_dir(&dir, 64).unwrap().fingerprint, first.fingerprint, "new weights, new fingerprint");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
