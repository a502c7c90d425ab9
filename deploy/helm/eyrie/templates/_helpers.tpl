{{/* Names: the release's prefix for every object. */}}
{{- define "eyrie.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "eyrie.labels" -}}
app.kubernetes.io/name: eyrie
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "eyrie.selector" -}}
app.kubernetes.io/name: eyrie
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "eyrie.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}{{ include "eyrie.fullname" . }}{{- else -}}{{ required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{/* An image reference: registry/repository:tag (tag: the chart's appVersion unless set). */}}
{{- define "eyrie.image" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}
{{- $repo := index $root.Values.images $name -}}
{{- $tag := $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- if $root.Values.image.registry -}}{{ printf "%s/%s:%s" $root.Values.image.registry $repo $tag }}{{- else -}}{{ printf "%s:%s" $repo $tag }}{{- end -}}
{{- end -}}

{{- define "eyrie.authSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "eyrie.fullname" .)) -}}
{{- end -}}

{{- define "eyrie.storeSecret" -}}
{{- .Values.store.credentials.existingSecret | default (printf "%s-store" (include "eyrie.fullname" .)) -}}
{{- end -}}

{{- define "eyrie.redisHost" -}}
{{- if .Values.redis.enabled -}}{{ include "eyrie.fullname" . }}-redis{{- else -}}{{ required "redis.external.host is required when redis.enabled is false" .Values.redis.external.host }}{{- end -}}
{{- end -}}

{{- define "eyrie.redisPort" -}}
{{- if .Values.redis.enabled -}}6379{{- else -}}{{ .Values.redis.external.port }}{{- end -}}
{{- end -}}

{{/* The environment every eyrie container gets: where Redis and the bucket are, and how to reach them. */}}
{{- define "eyrie.env" -}}
- name: EYRIE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "eyrie.authSecret" . }}, key: redis-password}
- name: EYRIE_REDIS_URL
  value: {{ printf "%s://:$(EYRIE_REDIS_PASSWORD)@%s:%s/%d" (ternary "rediss" "redis" (and (not .Values.redis.enabled) .Values.redis.external.tls)) (include "eyrie.redisHost" .) (include "eyrie.redisPort" .) (int .Values.redis.db) | quote }}
- name: EYRIE_STORE_URL
  value: {{ printf "s3://%s%s" .Values.store.bucket (ternary (printf "/%s" .Values.store.prefix) "" (ne .Values.store.prefix "")) | quote }}
{{- with .Values.store.endpoint }}
- name: EYRIE_S3_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.store.region }}
- name: EYRIE_S3_REGION
  value: {{ . | quote }}
{{- end }}
- name: EYRIE_S3_ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "eyrie.storeSecret" . }}, key: {{ .Values.store.credentials.accessKeyKey }}}
- name: EYRIE_S3_SECRET_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "eyrie.storeSecret" . }}, key: {{ .Values.store.credentials.secretKeyKey }}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "eyrie.authSecret" . }}, key: hf-token, optional: true}
- name: EYRIE_GPU_SCHEDULER
  value: kueue
- name: EYRIE_KUEUE_JOBS_FILE
  value: /etc/eyrie/gpu-jobs.json
{{- with .Values.inference.url }}
- name: EYRIE_INFERENCE_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.model }}
- name: EYRIE_MODEL
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := .Values.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* Mounts of the GPU Job templates (the orchestrator builds a run's Job from them). */}}
{{- define "eyrie.jobsVolume" -}}
- name: gpu-jobs
  configMap:
    name: {{ include "eyrie.fullname" . }}-gpu-jobs
{{- end -}}

{{- define "eyrie.jobsMount" -}}
- name: gpu-jobs
  mountPath: /etc/eyrie
  readOnly: true
{{- end -}}

{{- define "eyrie.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
{{- end -}}
