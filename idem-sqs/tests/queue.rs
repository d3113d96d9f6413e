//! idem-sqs against moto's SQS server (the cases follow).

fn main() {}
