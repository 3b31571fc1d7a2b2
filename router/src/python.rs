//! The `pagemill._router` extension module. The router's options are declared
//! once, on RouterConfig (config.rs); Python gets argv through and the option
//! table out, and never spells an option itself.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::config::{option_table, RouterConfig};

/// argv (program name first) -> a checked RouterConfig; a bad flag or value is a
/// ValueError carrying clap's message (which names the flag).
fn parse_checked(argv: Vec<String>) -> PyResult<RouterConfig> {
    let config = RouterConfig::from_argv(argv).map_err(|e| PyValueError::new_err(e.to_string()))?;
    config.check().map_err(PyValueError::new_err)?;
    Ok(config)
}

/// Parses and checks `argv` without serving: the launcher calls it before it
/// starts the shards, so that a bad router flag fails in a second, not after loading.
/// Returns the config as a dict of RouterConfig's fields.
#[pyfunction]
fn parse<'py>(py: Python<'py>, argv: Vec<String>) -> PyResult<Bound<'py, PyAny>> {
    let config = parse_checked(argv)?;
    let json = serde_json::to_string(&config).map_err(|e| PyValueError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}

/// Every router option: dest, flag, kind, value_name, default, help, choices, env, launcher_sets.
#[pyfunction]
fn options<'py>(py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
    option_table()
        .into_iter()
        .map(|o| {
            let d = PyDict::new(py);
            d.set_item("dest", o.dest)?;
            d.set_item("flag", o.flag)?;
            d.set_item("kind", o.kind)?;
            d.set_item("value_name", o.value_name)?;
            d.set_item("default", o.default)?;
            d.set_item("help", o.help)?;
            d.set_item("choices", o.choices)?;
            d.set_item("env", o.env)?;
            d.set_item("launcher_sets", o.launcher_sets)?;
            Ok(d)
        })
        .collect()
}

/// Parses `argv` (program name first) and serves until SIGINT/SIGTERM.
#[pyfunction]
fn serve(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    let config = parse_checked(argv)?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(format!("pagemill_router={}", config.log_level)))
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    py.detach(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
        runtime.block_on(crate::run(config))
    })
    .map_err(PyRuntimeError::new_err)
}

#[pymodule]
fn _router(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(serve, m)?)?;
    m.add_function(wrap_pyfunction!(parse, m)?)?;
    m.add_function(wrap_pyfunction!(options, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
