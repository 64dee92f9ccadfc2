variable "name" {
  description = "Prefix for every resource this module creates."
  type        = string
  default     = "spotrain-reclaims"
}

variable "webhook_url" {
  description = "Base URL of the spotrain webhook (https://...). Empty: no API destination, queue mode only."
  type        = string
  default     = ""
}

variable "webhook_token" {
  description = "Bearer token the webhook expects (SPOTRAIN_WEBHOOK_TOKEN). EventBridge keeps it in Secrets Manager."
  type        = string
  default     = ""
  sensitive   = true
}

variable "enable_queue" {
  description = "Also deliver the events to an SQS queue the webhook polls (SPOTRAIN_WEBHOOK_QUEUE_URL)."
  type        = bool
  default     = true
}

variable "webhook_role_name" {
  description = "IAM role the webhook runs as (e.g. its IRSA role). Empty: the consumer policy is created but not attached."
  type        = string
  default     = ""
}

variable "tags" {
  description = "Extra tags on every resource."
  type        = map(string)
  default     = {}
}
