{{/*
Names and pieces shared by Berth's triggerers. The Airflow chart's values arrive with `-f`; a
value this chart needs from them and cannot find fails the render, naming it and the fix.
*/}}

{{- define "berth.need" -}}
{{- printf "%s is missing: install this chart with the Airflow chart's values too (-f docker/helm/values.yaml)" . -}}
{{- end -}}

{{/* Berth's Airflow image: the Airflow chart's `images.airflow`, a digest winning over a tag. */}}
{{- define "berth.image" -}}
{{- $image := required (include "berth.need" "images.airflow") (.Values.images | default dict).airflow -}}
{{- $repository := required (include "berth.need" "images.airflow.repository") $image.repository -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (required (include "berth.need" "images.airflow.tag") $image.tag | toString) -}}
{{- end -}}
{{- end -}}

{{/* The Airflow chart's Secrets and configuration, named as that chart names them. */}}
{{- define "berth.airflowEnv" -}}
- name: AIRFLOW__CORE__FERNET_KEY  # the triggers' kwargs are stored encrypted
  valueFrom:
    secretKeyRef:
      name: {{ .Values.fernetKeySecretName | default (printf "%s-fernet-key" .Values.airflowRelease) }}
      key: fernet-key
- name: AIRFLOW__DATABASE__SQL_ALCHEMY_CONN
  valueFrom:
    secretKeyRef:
      name: {{ (.Values.data | default dict).metadataSecretName | default (printf "%s-airflow-metadata" .Values.airflowRelease) }}
      key: connection
- name: AIRFLOW__API__SECRET_KEY  # the API server fetches a running trigger's log with it
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiSecretKeySecretName | default (printf "%s-api-secret-key" .Values.airflowRelease) }}
      key: api-secret-key
{{- end -}}

{{- define "berth.airflowConfigVolume" -}}
- name: config
  configMap:
    name: {{ printf "%s-airflow-config" .Values.airflowRelease }}
{{- end -}}

{{- define "berth.airflowConfigMount" -}}
- name: config
  mountPath: /opt/airflow/airflow.cfg
  subPath: airflow.cfg
  readOnly: true
{{- end -}}

{{/*
The store's URL as the API server gets it (`apiServer.env`): one Secret for every holder, and no
triggerer without it.
*/}}
{{- define "berth.storeUrl" -}}
{{- $found := list -}}
{{- range ((.Values.apiServer | default dict).env | default list) -}}
{{- if eq .name "BERTH_STORE_URL" -}}{{- $found = append $found . -}}{{- end -}}
{{- end -}}
{{- if ne (len $found) 1 -}}
{{- fail (include "berth.need" "apiServer.env's BERTH_STORE_URL (from the Secret that holds the store's URL)") -}}
{{- end -}}
{{- toYaml (list (first $found)) -}}
{{- end -}}

{{- define "berth.labels" -}}
app.kubernetes.io/part-of: berth
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
