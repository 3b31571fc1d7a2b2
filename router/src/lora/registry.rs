//! The adapters this server serves, by name: those of `--lora-modules`
//! registered at launch, and those `/v1/load_lora_adapter` adds. Each
//! registration gets a new id. Unloading removes the name at once (new
//! requests naming it get 404); requests already holding the adapter keep
//! it and finish, and the shard frees it once no live request needs it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use super::adapter_config::check_adapter_dir;
use super::modules::{check_name, LoraModule};
use crate::adapter::{Adapter, AdapterRef};
use crate::error::RouterError;

/// `--enable-lora`, `--max-loras`, `--max-lora-rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraLimits {
    pub enabled: bool,
    /// Adapters the shard holds at once, and most distinct ones in a step.
    pub max_loras: u32,
    pub max_rank: u32,
}

#[derive(Debug)]
pub struct LoraRegistry {
    limits: LoraLimits,
    /// The base model's name: no adapter may take it.
    base: String,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_name: BTreeMap<String, AdapterRef>,
    /// Ids handed out so far (the next is one more): 0 is the base model.
    last_id: u32,
}

impl LoraRegistry {
    /// With the `--lora-modules` adapters registered; fails on the first
    /// that cannot be served, naming it.
    pub fn new(limits: LoraLimits, base: &str, modules: &[LoraModule]) -> Result<Self, String> {
        let registry = Self { limits, base: base.to_string(), inner: Mutex::new(Inner::default()) };
        if !limits.enabled && !modules.is_empty() {
            return Err("--lora-modules needs --enable-lora".into());
        }
        for m in modules {
            registry.load(&m.name, &m.path).map_err(|e| format!("--lora-modules {}: {e}", m.name))?;
        }
        Ok(registry)
    }

    /// A registry that serves no adapters (LoRA off).
    pub fn disabled(base: &str) -> Self {
        let limits = LoraLimits { enabled: false, max_loras: 0, max_rank: 0 };
        Self { limits, base: base.to_string(), inner: Mutex::new(Inner::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn limits(&self) -> LoraLimits {
        self.limits
    }

    /// Registers the adapter at `path` under `name` (checked first).
    pub fn load(&self, name: &str, path: &str) -> Result<AdapterRef, RouterError> {
        if !self.limits.enabled {
            return Err(RouterError::Validation(
                "LoRA is not enabled on this server (start it with --enable-lora)".into(),
            ));
        }
        check_name(name).map_err(RouterError::Validation)?;
        if name == self.base {
            return Err(RouterError::Validation(format!("`lora_name` {name:?} is the base model's name")));
        }
        if self.lock().by_name.contains_key(name) {
            return Err(RouterError::Validation(format!("The lora adapter '{name}' has already been loaded.")));
        }
        // The directory is read outside the lock.
        let checked = check_adapter_dir(Path::new(path), self.limits.max_rank).map_err(RouterError::Validation)?;
        let mut g = self.lock();
        if g.by_name.contains_key(name) {
            return Err(RouterError::Validation(format!("The lora adapter '{name}' has already been loaded.")));
        }
        g.last_id += 1;
        let adapter = Arc::new(Adapter {
            id: g.last_id,
            name: name.to_string(),
            path: path.to_string(),
            fingerprint: checked.fingerprint,
        });
        g.by_name.insert(name.to_string(), adapter.clone());
        tracing::info!(
            "LoRA adapter {name:?} (id {}, rank {}, {}) loaded from {path}",
            adapter.id,
            checked.rank,
            checked.target_modules.join(",")
        );
        Ok(adapter)
    }

    /// Removes `name`; requests already running with it finish.
    pub fn unload(&self, name: &str) -> Result<AdapterRef, RouterError> {
        if !self.limits.enabled {
            return Err(RouterError::Validation(
                "LoRA is not enabled on this server (start it with --enable-lora)".into(),
            ));
        }
        let removed = self.lock().by_name.remove(name);
        let adapter =
            removed.ok_or_else(|| RouterError::NotFound(format!("The lora adapter '{name}' cannot be found.")))?;
        tracing::info!("LoRA adapter {name:?} (id {}) unloaded", adapter.id);
        Ok(adapter)
    }

    /// The registered adapters, by name.
    pub fn list(&self) -> Vec<AdapterRef> {
        self.lock().by_name.values().cloned().collect()
    }

    /// What a request's `model` selects: None for the base model (no name,
    /// the base's name, or any name while LoRA is off: OpenAI clients send
    /// whatever model name they were configured with, and a server without
    /// adapters has one model to run), an adapter by its name, and otherwise
    /// `NotFound`: with LoRA on, a request never runs on the base model in
    /// place of an adapter it asked for.
    pub fn for_model(&self, name: Option<&str>) -> Result<Option<AdapterRef>, RouterError> {
        if !self.limits.enabled {
            return Ok(None);
        }
        self.resolve("model", name)
    }

    /// What TGI's `adapter_id` selects: a field that names nothing but an
    /// adapter, so an unknown one is `NotFound` whether LoRA is on or not.
    pub fn for_adapter_id(&self, name: Option<&str>) -> Result<Option<AdapterRef>, RouterError> {
        self.resolve("adapter_id", name)
    }

    fn resolve(&self, field: &str, name: Option<&str>) -> Result<Option<AdapterRef>, RouterError> {
        let name = match name {
            Some(n) if !n.is_empty() && n != self.base => n,
            _ => return Ok(None),
        };
        let found = self.lock().by_name.get(name).cloned();
        match found {
            Some(a) => Ok(Some(a)),
            None => Err(RouterError::NotFound(format!(
                "`{field}`: the model `{name}` does not exist (served: {})",
                self.served_names().join(", ")
            ))),
        }
    }

    /// The base model's name, then every adapter's.
    fn served_names(&self) -> Vec<String> {
        std::iter::once(self.base.clone()).chain(self.lock().by_name.keys().cloned()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter_dir(tag: &str, rank: u32) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pagemill-lora-reg-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = format!(r#"{{"r": {rank}, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}}"#);
        std::fs::write(dir.join("adapter_config.json"), config).unwrap();
        std::fs::write(dir.join("adapter_model.safetensors"), b"weights").unwrap();
        dir
    }

    const ON: LoraLimits = LoraLimits { enabled: true, max_loras: 2, max_rank: 16 };

    #[test]
    fn names_resolve_and_every_registration_gets_a_new_id() {
        let dir = adapter_dir("ids", 8);
        let path = dir.to_str().unwrap();
        let reg = LoraRegistry::new(ON, "base", &[LoraModule { name: "sql".into(), path: path.into() }]).unwrap();
        let sql = reg.for_model(Some("sql")).unwrap().unwrap();
        assert_eq!((sql.id, sql.path.as_str()), (1, path));
        for base in [None, Some(""), Some("base")] {
            assert!(reg.for_model(base).unwrap().is_none(), "{base:?} is the base model");
        }
        let err = reg.for_adapter_id(Some("chat")).unwrap_err();
        assert!(err.to_string().starts_with("`adapter_id`: the model `chat` does not exist"), "{err}");
        let err = reg.for_model(Some("chat")).unwrap_err();
        assert_eq!(err.error_type(), "not_found");
        assert!(err.to_string().contains("served: base, sql"), "{err}");
        assert_eq!(reg.unload("sql").unwrap().id, 1);
        assert_eq!(reg.for_model(Some("sql")).unwrap_err().error_type(), "not_found");
        assert_eq!(reg.load("sql", path).unwrap().id, 2, "loaded again: a new id");
        assert_eq!(reg.list().len(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn loading_and_unloading_refuse_what_they_cannot_do() {
        let dir = adapter_dir("refuse", 32);
        let path = dir.to_str().unwrap();
        let reg = LoraRegistry::new(LoraLimits { max_rank: 64, ..ON }, "base", &[]).unwrap();
        reg.load("a", path).unwrap();
        let dup = reg.load("a", path).unwrap_err();
        assert!(matches!(dup, RouterError::Validation(_)) && dup.to_string().contains("already been loaded"));
        assert!(reg.load("base", path).unwrap_err().to_string().contains("base model"));
        assert!(reg.load("b", "/no/such/dir").unwrap_err().to_string().contains("not a directory"));
        assert_eq!(reg.unload("nope").unwrap_err().error_type(), "not_found");
        let small = LoraRegistry::new(ON, "base", &[]).unwrap();
        assert!(small.load("a", path).unwrap_err().to_string().contains("exceeds --max-lora-rank 16"));
        let off = LoraRegistry::disabled("base");
        assert!(off.load("a", path).unwrap_err().to_string().contains("--enable-lora"));
        assert!(off.unload("a").unwrap_err().to_string().contains("--enable-lora"));
        assert!(off.for_model(Some("anything")).unwrap().is_none(), "LoRA off: `model` is not read");
        assert_eq!(off.for_adapter_id(Some("anything")).unwrap_err().error_type(), "not_found");
        assert!(off.for_adapter_id(Some("base")).unwrap().is_none());
        let launch = LoraRegistry::new(ON, "base", &[LoraModule { name: "x".into(), path: "/no/such".into() }]);
        assert!(launch.unwrap_err().starts_with("--lora-modules x: "));
        let off_with_modules = LoraRegistry::new(
            LoraLimits { enabled: false, ..ON },
            "base",
            &[LoraModule { name: "x".into(), path: path.into() }],
        );
        assert!(off_with_modules.unwrap_err().contains("needs --enable-lora"));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
