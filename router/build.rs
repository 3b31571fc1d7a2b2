// Generates the gRPC client from proto/generate.proto with a vendored protoc,
// and the Python message module for the shard with the same protoc, so both
// sides of the contract always come from one compiler and one file.
use std::path::PathBuf;
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest.parent().ok_or("router/ has no parent")?.to_path_buf();
    let proto_dir = root.join("proto");
    let proto = proto_dir.join("generate.proto");
    println!("cargo:rerun-if-changed={}", proto.display());

    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", &protoc);
    tonic_prost_build::configure().build_server(false).compile_protos(&[&proto], &[&proto_dir])?;

    // Python messages (the shard registers its handlers by hand, so no grpc
    // plugin is needed). Skipped when the server tree is absent (crate-only builds).
    let py_out = root.join("server").join("pagemill").join("proto");
    if py_out.is_dir() {
        let status = Command::new(&protoc)
            .arg(format!("-I{}", proto_dir.display()))
            .arg(format!("--python_out={}", py_out.display()))
            .arg(format!("--pyi_out={}", py_out.display()))
            .arg(&proto)
            .status()?;
        if !status.success() {
            return Err("protoc --python_out failed".into());
        }
    }
    Ok(())
}
