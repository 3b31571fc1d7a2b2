//! One shard: a tonic channel over a unix socket.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::proto::pb;
use crate::proto::pb::text_generation_service_client::TextGenerationServiceClient;

type Rpc<T> = Result<T, tonic::Status>;

#[derive(Debug, Clone)]
pub struct ShardClient {
    inner: TextGenerationServiceClient<Channel>,
    path: PathBuf,
}

impl ShardClient {
    pub async fn connect(path: &Path) -> Result<Self, tonic::transport::Error> {
        let socket = path.to_path_buf();
        // The URI is ignored by the connector; tonic only needs a valid one.
        let channel = Endpoint::try_from("http://[::]:50051")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
            }))
            .await?;
        let inner = TextGenerationServiceClient::new(channel)
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20);
        Ok(Self {
            inner,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub async fn info(&mut self) -> Rpc<pb::InfoResponse> {
        Ok(self.inner.info(pb::InfoRequest {}).await?.into_inner())
    }

    pub async fn health(&mut self) -> Rpc<pb::HealthResponse> {
        Ok(self.inner.health(pb::HealthRequest {}).await?.into_inner())
    }

    pub async fn warmup(&mut self, req: pb::WarmupRequest) -> Rpc<pb::WarmupResponse> {
        Ok(self.inner.warmup(req).await?.into_inner())
    }

    pub async fn step(&mut self, req: pb::StepRequest) -> Rpc<pb::StepResponse> {
        Ok(self.inner.step(req).await?.into_inner())
    }
}
